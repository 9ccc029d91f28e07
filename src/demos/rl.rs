//! Agent and observers, as in reinforcement learning with RPC: the agent (rank 0) owns the
//! policy; each observer (ranks 1..) owns an environment behind an RRef the agent created with
//! `remote`. Every round the agent asks all observers, concurrently through their RRefs, to run
//! an episode; observers call back into the agent to choose each action and report rewards.
//! Then the agent improves the policy with REINFORCE (local autograd over the log-probabilities
//! it recorded while serving the observers) and Adam.
//!
//! The environment is a contextual bandit: the state is 4 random numbers, action 1 pays 1 when
//! `s0 + s1 > 0` and action 0 pays 1 otherwise. A random policy earns 0.5 per step.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use serde::{Deserialize, Serialize};
use sluice_agent::{Agent, CallContext, Payload, RRef, Registry};
use sluice_autograd::{linear, DType, Optimizer, OptimizerKind, Parameter, Rng, Tensor, UpdateMode};

use super::{agent_options, handler_error, Demo};

const STATE: usize = 4;
const STEPS: u32 = 20;

fn policy() -> &'static [Parameter] {
    static P: OnceLock<Vec<Parameter>> = OnceLock::new();
    P.get_or_init(|| {
        vec![
            Parameter::new("w", Tensor::randn(&[2, STATE], 0.1, 21, DType::F32).expect("init")),
            Parameter::new("b", Tensor::zeros(&[2], DType::F32).expect("init")),
        ]
    })
}

/// What the agent recorded for one observer this round: log π(a|s) and the reward.
type Trace = Vec<(Tensor, f32)>;

static TRACES: Mutex<Option<HashMap<u32, Trace>>> = Mutex::new(None);
static SAMPLER: Mutex<Option<Rng>> = Mutex::new(None);

/// An observer's environment (lives on the observer; the agent holds an RRef to it).
#[derive(Serialize, Deserialize)]
struct Observer {
    rng: Mutex<u64>,
}

fn select_action(observer: u32, state: Vec<f32>) -> sluice_autograd::Result<u32> {
    let p = policy();
    let s = Tensor::from_vec(state, &[1, STATE])?;
    let logp = linear(&s, &p[0].tensor(), Some(&p[1].tensor()))?.log_softmax(-1)?;
    let probs = logp.detach().exp()?.to_vec::<f32>()?;
    let u = SAMPLER.lock().unwrap().get_or_insert_with(|| Rng::new(5)).unit() as f32;
    let action = u32::from(u >= probs[0]);
    let chosen = logp.narrow(1, action as usize, 1)?;
    TRACES
        .lock()
        .unwrap()
        .get_or_insert_with(HashMap::new)
        .entry(observer)
        .or_default()
        .push((chosen, 0.0));
    Ok(action)
}

fn registry() -> Registry {
    let mut r = Registry::new();
    r.handler(
        "select_action",
        |_cx: &CallContext, (observer, state): (u32, Vec<f32>)| select_action(observer, state).map_err(handler_error),
    )
    .handler("report_reward", |_cx: &CallContext, (observer, reward): (u32, f32)| {
        if let Some(last) = TRACES
            .lock()
            .unwrap()
            .as_mut()
            .and_then(|t| t.get_mut(&observer))
            .and_then(|t| t.last_mut())
        {
            last.1 = reward;
        }
        Ok(())
    })
    .handler("make_observer", |cx: &CallContext, (): ()| {
        Ok(Observer {
            rng: Mutex::new(cx.agent.info().id as u64 * 7919),
        })
    })
    .method("run_episode", |cx: &CallContext, env: &Observer, steps: u32| {
        let me = cx.agent.info().id;
        let mut seed = env.rng.lock().unwrap();
        let mut rng = Rng::new(*seed);
        *seed += 1;
        let mut total = 0.0f32;
        for _ in 0..steps {
            let state: Vec<f32> = (0..STATE).map(|_| rng.normal() as f32).collect();
            let action: u32 = cx.agent.call(0u32, "select_action", &(me, state.clone()))?;
            let right = u32::from(state[0] + state[1] > 0.0);
            let reward = if action == right { 1.0 } else { 0.0 };
            total += reward;
            cx.agent.call::<_, ()>(0u32, "report_reward", &(me, reward))?;
        }
        Ok(total / steps as f32)
    });
    r
}

fn improve(opt: &Optimizer) -> anyhow::Result<f32> {
    let traces: Vec<(Tensor, f32)> = TRACES
        .lock()
        .unwrap()
        .take()
        .unwrap_or_default()
        .into_values()
        .flatten()
        .collect();
    let baseline = traces.iter().map(|(_, r)| r).sum::<f32>() / traces.len().max(1) as f32;
    let mut loss: Option<Tensor> = None;
    for (logp, reward) in &traces {
        let term = logp.mul_scalar(-((reward - baseline) as f64))?;
        loss = Some(match loss {
            None => term,
            Some(l) => l.add(&term)?,
        });
    }
    if let Some(loss) = loss {
        loss.mul_scalar(1.0 / traces.len() as f64)?.sum()?.backward()?;
        opt.step()?;
    }
    Ok(baseline)
}

pub fn run(demo: &Demo, rank: u32) -> anyhow::Result<()> {
    let Demo::Rl { observers, rounds } = *demo else {
        unreachable!()
    };
    let agent = Agent::init(agent_options(demo.worker_name(rank)), registry())?;
    if rank == 0 {
        let envs: Vec<RRef<Observer>> = (1..=observers)
            .map(|o| agent.remote(o, "make_observer", Payload::encode(&())?))
            .collect::<Result<_, _>>()?;
        let opt = Optimizer::new(OptimizerKind::adam(0.05), policy().to_vec(), UpdateMode::Locked);
        let mut history = Vec::new();
        for _ in 0..rounds {
            let episodes: Vec<_> = envs.iter().map(|env| env.rpc_async("run_episode", &STEPS)).collect();
            for e in episodes {
                e.wait()?.decode::<f32>()?;
            }
            history.push(improve(&opt)?);
        }
        let first = history.iter().take(3).sum::<f32>() / history.len().clamp(1, 3) as f32;
        let last = history.iter().rev().take(3).sum::<f32>() / history.len().clamp(1, 3) as f32;
        println!(
            "agent and {observers} observers: {rounds} rounds of {STEPS}-step episodes; mean reward per step {first:.2} (first 3 rounds) → {last:.2} (last 3)"
        );
        drop(envs);
    }
    agent.shutdown()?;
    Ok(())
}
