//! A parameter server that survives a trainer's crash, under `sluice launch`:
//!
//! ```text
//! cargo build --release --examples
//! sluice launch --role ps=1 --role trainer=3 --max-restarts 1 -- target/release/examples/resilient_ps
//! ```
//!
//! The server hands out shards of work. Trainer 1 aborts in its first life while holding a
//! shard; the server hears `MembershipEvent::Lost`, puts that trainer's shards back in the
//! queue, and the launcher restarts the trainer, which rejoins under its name and keeps
//! working. The server checks that every shard's result arrived exactly once.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sluice_agent::{Agent, AgentOptions, CallContext, HandlerError, MembershipEvent, Registry};

const SHARDS: u64 = 30;

#[derive(Default)]
struct Work {
    queue: VecDeque<u64>,
    /// Worker id (one incarnation) → shards it holds.
    holding: HashMap<u32, Vec<u64>>,
    results: BTreeMap<u64, u64>,
    reassigned: usize,
    duplicates: usize,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let options = AgentOptions::from_env()?;
    let role = std::env::var("ROLE_NAME").unwrap_or_default();
    if role == "ps" {
        server(options)
    } else {
        trainer(options)
    }
}

fn server(options: AgentOptions) -> Result<(), Box<dyn std::error::Error>> {
    let work = Arc::new(Mutex::new(Work {
        queue: (0..SHARDS).collect(),
        ..Work::default()
    }));
    let mut r = Registry::new();
    let w = work.clone();
    r.handler("next_shard", move |cx: &CallContext, (): ()| {
        let mut w = w.lock().unwrap();
        let shard = w.queue.pop_front();
        if let Some(s) = shard {
            w.holding.entry(cx.caller.id).or_default().push(s);
        }
        let finished = w.results.len() as u64 == SHARDS;
        Ok((shard, finished))
    });
    let w = work.clone();
    r.handler("done", move |cx: &CallContext, (shard, result): (u64, u64)| {
        let mut w = w.lock().unwrap();
        if let Some(h) = w.holding.get_mut(&cx.caller.id) {
            h.retain(|s| *s != shard);
        }
        if result != shard * shard {
            return Err(HandlerError::new("BadResult", format!("shard {shard} gave {result}")));
        }
        if w.results.insert(shard, result).is_some() {
            w.duplicates += 1;
        }
        Ok(())
    });
    let agent = Agent::init(options, r)?;
    let w = work.clone();
    agent.on_membership(move |e| {
        if let MembershipEvent::Lost { worker, detail } = e {
            let mut w = w.lock().unwrap();
            let lost = w.holding.remove(&worker.id).unwrap_or_default();
            println!("lost {worker} ({detail}); reassigning shards {lost:?}");
            w.reassigned += lost.len();
            for s in lost.into_iter().rev() {
                w.queue.push_front(s);
            }
        }
    });
    while work.lock().unwrap().results.len() < SHARDS as usize {
        std::thread::sleep(Duration::from_millis(20));
    }
    let w = work.lock().unwrap();
    println!(
        "all {SHARDS} shards done: {} reassigned after a loss, {} duplicate results",
        w.reassigned, w.duplicates
    );
    let ok = w.results.len() as u64 == SHARDS && w.duplicates == 0;
    drop(w);
    // The trainers leave once they hear that everything is done.
    while agent.workers().len() > 1 {
        std::thread::sleep(Duration::from_millis(20));
    }
    agent.leave(Duration::from_secs(10))?;
    if !ok {
        return Err("lost or duplicated results".into());
    }
    Ok(())
}

fn trainer(options: AgentOptions) -> Result<(), Box<dyn std::error::Error>> {
    let crash = std::env::var("SLUICE_WORKER_NAME").as_deref() == Ok("trainer1")
        && std::env::var("TORCHELASTIC_RESTART_COUNT").as_deref() == Ok("0");
    let agent = Agent::init(options, Registry::new())?;
    let mut done = 0;
    loop {
        let (shard, finished): (Option<u64>, bool) = agent.call("ps0", "next_shard", &())?;
        let Some(shard) = shard else {
            if finished {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
            continue;
        };
        std::thread::sleep(Duration::from_millis(30)); // the "training"
        if crash && done == 3 {
            eprintln!("simulated crash while holding shard {shard}");
            std::process::abort();
        }
        agent.call::<_, ()>("ps0", "done", &(shard, shard * shard))?;
        done += 1;
    }
    println!("{} finished {done} shards", agent.info());
    agent.leave(Duration::from_secs(10))?;
    Ok(())
}
