//! Gradients pushed by hand, without autograd (the distributed-autograd version is the
//! `parameter_server` example): one server holds the weights of a linear model, several
//! trainer processes fetch them, compute gradients on their own data, and push the gradients
//! back concurrently (Hogwild-style: the server applies each push at once).
//!
//! Run: `cargo run --release --example push_gradients -- [TRAINERS] [STEPS]`
//!
//! This process is the server (rank 0, hosting the rendezvous store); it starts the trainers as
//! child processes (ranks 1..=TRAINERS) with the torchrun variables set, exactly as a launcher
//! would. Weights and gradients travel as tensors (raw f32 bytes), not inside the serialized
//! value.

use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::Instant;

use bytes::Bytes;
use sluice::agent::{Agent, AgentOptions, CallContext, HandlerError, Payload, Registry, Tensor};

const DIM: usize = 256;
const LEARNING_RATE: f32 = 0.02;

/// The model everyone tries to recover: w*[i] = sin(i).
fn truth(i: usize) -> f32 {
    (i as f32).sin()
}

fn to_bytes(v: &[f32]) -> Bytes {
    Bytes::from(v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())
}

fn from_bytes(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

static WEIGHTS: Mutex<Vec<f32>> = Mutex::new(Vec::new());

fn registry() -> Registry {
    let mut r = Registry::new();
    r.raw_handler("get_weights", |_: &CallContext, _| {
        let w = WEIGHTS.lock().unwrap();
        Ok(Payload::empty().with_tensors(vec![Tensor::cpu(to_bytes(&w))]))
    })
    .raw_handler("push_gradient", |_: &CallContext, p: Payload| {
        let t = p
            .tensors
            .first()
            .ok_or_else(|| HandlerError::new("ValueError", "no gradient tensor"))?;
        let g = from_bytes(t.buffer.as_cpu().expect("CPU tensor"));
        if g.len() != DIM {
            return Err(HandlerError::new(
                "ValueError",
                format!("gradient of {} values, expected {DIM}", g.len()),
            ));
        }
        let mut w = WEIGHTS.lock().unwrap();
        for (w, g) in w.iter_mut().zip(g) {
            *w -= LEARNING_RATE * g;
        }
        Ok(Payload::empty())
    });
    r
}

/// A trainer: fetch weights, compute the mean-squared-error gradient on a fresh batch, push it.
fn trainer(rank: u32, steps: usize) -> Result<(), Box<dyn std::error::Error>> {
    let agent = Agent::init(AgentOptions::new(format!("trainer{rank}")), registry())?;
    let mut seed = 0x9E37_79B9u32.wrapping_mul(rank + 1);
    let mut random = move || {
        seed ^= seed << 13;
        seed ^= seed >> 17;
        seed ^= seed << 5;
        (seed as f32 / u32::MAX as f32) * 2.0 - 1.0
    };
    let mut last_loss = 0.0;
    for _ in 0..steps {
        let reply = agent.rpc_sync("ps", "get_weights", Payload::empty())?;
        let w = from_bytes(reply.tensors[0].buffer.as_cpu().expect("CPU tensor"));
        let mut grad = vec![0f32; DIM];
        let batch = 16;
        let mut loss = 0.0;
        for _ in 0..batch {
            let x: Vec<f32> = (0..DIM).map(|_| random()).collect();
            let y: f32 = x.iter().enumerate().map(|(i, x)| x * truth(i)).sum();
            let pred: f32 = x.iter().zip(&w).map(|(x, w)| x * w).sum();
            let err = pred - y;
            loss += err * err / batch as f32;
            for (g, x) in grad.iter_mut().zip(&x) {
                *g += 2.0 * err * x / batch as f32;
            }
        }
        last_loss = loss;
        agent.rpc_sync(
            "ps",
            "push_gradient",
            Payload::empty().with_tensors(vec![Tensor::cpu(to_bytes(&grad))]),
        )?;
    }
    println!("trainer{rank}: last batch loss {last_loss:.5}");
    agent.shutdown()?;
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if let Ok(rank) = std::env::var("RANK") {
        let steps = std::env::var("PS_STEPS")?.parse()?;
        return trainer(rank.parse()?, steps);
    }
    let args: Vec<String> = std::env::args().collect();
    let trainers: u32 = args.get(1).map(|s| s.parse()).transpose()?.unwrap_or(3);
    let steps: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(2000);
    *WEIGHTS.lock().unwrap() = vec![0.0; DIM];
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let world = trainers + 1;
    let exe = std::env::current_exe()?;
    let children: Vec<_> = (1..world)
        .map(|rank| {
            Command::new(&exe)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("PS_STEPS", steps.to_string())
                .stdin(Stdio::null())
                .spawn()
        })
        .collect::<Result<_, _>>()?;
    let start = Instant::now();
    let agent = Agent::init(
        AgentOptions::new("ps")
            .rank(0, world)
            .store(format!("127.0.0.1:{port}")),
        registry(),
    )?;
    // The server only serves; shutdown returns once every trainer is done.
    agent.shutdown()?;
    let elapsed = start.elapsed();
    for mut c in children {
        let status = c.wait()?;
        if !status.success() {
            return Err(format!("a trainer failed: {status}").into());
        }
    }
    let w = WEIGHTS.lock().unwrap();
    let distance = (0..DIM).map(|i| (w[i] - truth(i)).powi(2)).sum::<f32>().sqrt();
    let pushes = trainers as usize * steps;
    println!(
        "{trainers} trainers x {steps} steps: {pushes} pushes and {pushes} fetches in {:.2} s ({:.0} RPCs/s); |w - w*| = {distance:.4} (started at {:.4})",
        elapsed.as_secs_f64(),
        2.0 * pushes as f64 / elapsed.as_secs_f64(),
        (0..DIM).map(|i| truth(i).powi(2)).sum::<f32>().sqrt()
    );
    Ok(())
}
