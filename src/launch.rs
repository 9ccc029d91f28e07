//! `sluice launch`: starts a job's workers on this host.
//!
//! - `--nproc N -- CMD` starts N copies of CMD; `--role ps=1 --role trainer=4 -- CMD` starts
//!   each role's count, every process told its role, its rank within the role and in the job,
//!   and the world size through the environment (torchrun's variables included: `RANK`,
//!   `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`, `ROLE_NAME`, `ROLE_RANK`,
//!   `ROLE_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, `TORCHELASTIC_RESTART_COUNT`), plus
//!   `SLUICE_WORKER_NAME` (`trainer2`, or `worker5` without roles) and `SLUICE_STORE`.
//! - The launcher serves the embedded store itself (or passes `--store URL` on), so any
//!   worker, rank 0 included, may fail and be restarted without taking the rendezvous along.
//! - Output is prefixed by worker name; SIGINT, SIGTERM and SIGHUP are forwarded to every
//!   worker; the first worker to fail (with no restarts left) is reported with its exit status
//!   or signal, the others are stopped (SIGTERM, then SIGKILL after a grace period), and the
//!   launcher exits non-zero.
//! - `--max-restarts K` restarts a failed worker under the same name and rank, up to K times
//!   per worker; it rejoins the group as a new incarnation (see the agent's membership docs).
//!
//! On clusters, start workers with the scheduler's own launcher (`srun`, `mpirun`): the agent
//! reads ranks from their variables.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};

/// The launcher's options.
#[derive(clap::Args, Debug, Clone)]
pub struct LaunchArgs {
    /// Number of workers (without --role).
    #[arg(long, conflicts_with = "roles")]
    pub nproc: Option<u32>,
    /// A role and its count, `NAME=COUNT`; repeat for several roles.
    #[arg(long = "role", value_name = "NAME=COUNT", value_parser = parse_role)]
    pub roles: Vec<(String, u32)>,
    /// Restart a failed worker (same name and rank) up to this many times.
    #[arg(long, default_value_t = 0)]
    pub max_restarts: u32,
    /// Use this store (`etcd://host:port/prefix`, `tcp://host:port`) instead of serving one.
    #[arg(long)]
    pub store: Option<String>,
    /// Seconds between SIGTERM and SIGKILL when stopping workers.
    #[arg(long, default_value_t = 5.0)]
    pub grace: f64,
    /// The command every worker runs.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub cmd: Vec<String>,
}

fn parse_role(s: &str) -> Result<(String, u32), String> {
    let (name, count) = s.split_once('=').ok_or("expected NAME=COUNT")?;
    sluice_agent::name::validate_name(name).map_err(|e| e.to_string())?;
    if name.ends_with(|c: char| c.is_ascii_digit()) {
        return Err(format!(
            "role `{name}` ends in a digit; worker names append the role rank"
        ));
    }
    let count: u32 = count.parse().map_err(|e| format!("count `{count}`: {e}"))?;
    if count == 0 {
        return Err("a role needs at least one process".into());
    }
    Ok((name.to_owned(), count))
}

/// One worker's identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    pub name: String,
    pub role: String,
    pub rank: u32,
    pub role_rank: u32,
    pub role_size: u32,
}

/// The workers `args` asks for, in rank order.
pub fn slots(args: &LaunchArgs) -> anyhow::Result<Vec<Slot>> {
    let roles = match (&args.nproc, args.roles.is_empty()) {
        (Some(n), true) => vec![("worker".to_owned(), *n)],
        (None, false) => args.roles.clone(),
        (None, true) => bail!("give --nproc N or at least one --role NAME=COUNT"),
        (Some(_), false) => bail!("--nproc and --role exclude each other"),
    };
    let mut out = Vec::new();
    for (role, count) in roles {
        if out.iter().any(|s: &Slot| s.role == role) {
            bail!("role `{role}` given twice");
        }
        for r in 0..count {
            out.push(Slot {
                name: format!("{role}{r}"),
                role: role.clone(),
                rank: out.len() as u32,
                role_rank: r,
                role_size: count,
            });
        }
    }
    if out.is_empty() {
        bail!("no workers to start");
    }
    Ok(out)
}

/// The environment of `slot` in a world of `world`.
pub fn environment(slot: &Slot, world: u32, store: &str, restarts: u32) -> Vec<(String, String)> {
    let mut env = vec![
        ("RANK", slot.rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_RANK", slot.rank.to_string()),
        ("LOCAL_WORLD_SIZE", world.to_string()),
        ("GROUP_RANK", "0".to_owned()),
        ("ROLE_NAME", slot.role.clone()),
        ("ROLE_RANK", slot.role_rank.to_string()),
        ("ROLE_WORLD_SIZE", slot.role_size.to_string()),
        ("TORCHELASTIC_RESTART_COUNT", restarts.to_string()),
        ("SLUICE_WORKER_NAME", slot.name.clone()),
        ("SLUICE_STORE", store.to_owned()),
        ("SLUICE_STORE_SERVED", "1".to_owned()),
    ];
    if let Some((host, port)) = store.strip_prefix("tcp://").and_then(|a| a.rsplit_once(':')) {
        env.push(("MASTER_ADDR", host.to_owned()));
        env.push(("MASTER_PORT", port.to_owned()));
    }
    env.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()
}

enum Event {
    Exited(usize, u64, ExitStatus),
    Signal(i32),
}

struct Running {
    slot: Slot,
    child: Option<Child>,
    generation: u64,
    restarts: u32,
    done: Option<ExitStatus>,
}

/// A group of worker processes to start and watch: what each runs, how it is named, and how
/// its output is shown. `sluice launch` and the demos (`sluice demo …`) both run one.
pub struct Job {
    /// Prefix of the supervisor's own messages (`sluice launch`, `sluice demo`).
    pub label: &'static str,
    pub slots: Vec<Slot>,
    /// The program and its arguments.
    pub cmd: Vec<std::ffi::OsString>,
    /// Set in every worker's environment besides the launcher's own variables.
    pub env: Vec<(String, String)>,
    /// Prefix each line a worker writes with `[name]` and close with a line on how the job
    /// ended (otherwise output is inherited as is, and the caller reports the outcome).
    pub prefix_output: bool,
    pub max_restarts: u32,
    /// Between SIGTERM and SIGKILL when stopping workers.
    pub grace: Duration,
    /// A store to pass on (`None`: serve the embedded store here).
    pub store: Option<String>,
}

/// How a supervised job ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every worker exited with status 0.
    Finished,
    /// The first failure (`worker NAME (rank R) failed: exit code 1`, or the signal that
    /// interrupted the job); the other workers were stopped.
    Failed(String),
}

/// Runs the job; returns the launcher's exit code.
pub fn launch(args: LaunchArgs) -> anyhow::Result<i32> {
    let job = Job {
        label: "sluice launch",
        slots: slots(&args)?,
        cmd: args.cmd.iter().map(Into::into).collect(),
        env: Vec::new(),
        prefix_output: true,
        max_restarts: args.max_restarts,
        grace: Duration::from_secs_f64(args.grace.max(0.0)),
        store: args.store.clone(),
    };
    Ok(match supervise(&job)? {
        Outcome::Finished => 0,
        Outcome::Failed(_) => 1,
    })
}

/// Starts every worker of `job` and watches them until all have exited. The first worker to
/// fail (with no restarts left) is reported with its exit status or signal and the others
/// are stopped (SIGTERM, then SIGKILL after the grace period); SIGINT, SIGTERM and SIGHUP are
/// forwarded to every worker. Workers die with the supervisor if it is killed (parent-death
/// signal), so none outlives the store it serves. Call it from the thread that stays alive
/// for the whole job (the parent-death signal follows the thread that started a worker).
pub fn supervise(job: &Job) -> anyhow::Result<Outcome> {
    let world = job.slots.len() as u32;
    let label = job.label;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let (_server, store) = match &job.store {
        Some(url) => (None, url.clone()),
        None => {
            // Workers inherit SLUICE_SECRET / SLUICE_SECRET_FILE, and so does this store.
            let secret = sluice_channel::Secret::from_env().context("reading the shared secret")?;
            let server = runtime
                .block_on(sluice_agent::store::StoreServer::start_with(
                    "127.0.0.1:0",
                    Default::default(),
                    secret,
                ))
                .context("cannot start the store")?;
            let url = format!("tcp://{}", server.address());
            (Some(server), url)
        }
    };
    let (tx, rx) = mpsc::channel::<Event>();
    forward_signals(tx.clone())?;
    let mut workers: Vec<Running> = job
        .slots
        .iter()
        .map(|slot| Running {
            slot: slot.clone(),
            child: None,
            generation: 0,
            restarts: 0,
            done: None,
        })
        .collect();
    let mut failure: Option<String> = None;
    let mut stopping: Option<Instant> = None;
    // Whether `failure` names a worker that exited with an error code: often only the echo of
    // another's death (its peer was lost), which a worker killed by a signal we did not send
    // replaces as the cause, however the two exits' reports were ordered.
    let mut failure_is_an_exit_code = false;
    // The signals this launcher sent: a worker they end is not a cause.
    let mut sent_kill = false;
    for i in 0..workers.len() {
        if let Err(e) = start(job, &mut workers[i], i, world, &store, &tx) {
            // Stop the ones already started before reporting.
            for w in workers.iter_mut() {
                signal(w, nix::sys::signal::Signal::SIGKILL);
            }
            return Err(e);
        }
    }
    eprintln!(
        "{label}: {} workers ({}), store {store}",
        world,
        workers
            .iter()
            .map(|w| format!("{} pid {}", w.slot.name, w.child.as_ref().map_or(0, Child::id)))
            .collect::<Vec<_>>()
            .join(", ")
    );
    loop {
        if workers.iter().all(|w| w.done.is_some()) {
            break;
        }
        let event = match stopping {
            Some(since) => {
                match rx.recv_timeout(job.grace.saturating_sub(since.elapsed()).max(Duration::from_millis(10))) {
                    Ok(e) => e,
                    Err(_) => {
                        if since.elapsed() >= job.grace {
                            sent_kill = true;
                            for w in workers.iter_mut().filter(|w| w.done.is_none()) {
                                signal(w, nix::sys::signal::Signal::SIGKILL);
                            }
                        }
                        continue;
                    }
                }
            }
            None => rx.recv().context("launcher event channel")?,
        };
        match event {
            Event::Signal(sig) => {
                let s = nix::sys::signal::Signal::try_from(sig).unwrap_or(nix::sys::signal::Signal::SIGTERM);
                eprintln!("{label}: got {s}; forwarding it to every worker");
                for w in workers.iter_mut().filter(|w| w.done.is_none()) {
                    signal(w, s);
                }
                failure.get_or_insert_with(|| format!("interrupted by {s}"));
                failure_is_an_exit_code = false;
                sent_kill = true; // whatever it ends now was ended by us
                stopping.get_or_insert_with(Instant::now);
            }
            Event::Exited(i, generation, status) => {
                let w = &mut workers[i];
                if w.generation != generation {
                    continue;
                }
                w.child = None;
                if status.success() || stopping.is_some() {
                    w.done = Some(status);
                    if !status.success() && failure_is_an_exit_code && killed_from_outside(status, sent_kill) {
                        let msg = format!(
                            "worker {} (rank {}) failed: {}",
                            w.slot.name,
                            w.slot.rank,
                            describe(status)
                        );
                        eprintln!("{label}: {msg}");
                        failure = Some(msg);
                        failure_is_an_exit_code = false;
                    }
                    continue;
                }
                let why = describe(status);
                if w.restarts < job.max_restarts {
                    w.restarts += 1;
                    eprintln!(
                        "{label}: worker {} (rank {}) failed: {why}; restarting it ({}/{})",
                        w.slot.name, w.slot.rank, w.restarts, job.max_restarts
                    );
                    start(job, &mut workers[i], i, world, &store, &tx)?;
                    continue;
                }
                w.done = Some(status);
                let msg = format!("worker {} (rank {}) failed: {why}", w.slot.name, w.slot.rank);
                eprintln!("{label}: {msg}; stopping the others");
                if failure.is_none() {
                    failure_is_an_exit_code = status.code().is_some();
                }
                failure.get_or_insert(msg);
                stopping.get_or_insert_with(Instant::now);
                for w in workers.iter_mut().filter(|w| w.done.is_none()) {
                    signal(w, nix::sys::signal::Signal::SIGTERM);
                }
            }
        }
    }
    Ok(match failure {
        Some(f) => {
            if job.prefix_output {
                eprintln!("{label}: job failed: {f}");
            }
            Outcome::Failed(f)
        }
        None => {
            if job.prefix_output {
                eprintln!("{label}: all {world} workers finished");
            }
            Outcome::Finished
        }
    })
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(s)) => match nix::sys::signal::Signal::try_from(s) {
            Ok(sig) => format!("killed by {sig}"),
            Err(_) => format!("killed by signal {s}"),
        },
        _ => status.to_string(),
    }
}

/// Whether `status` is a death by a signal this launcher did not send: anything but the
/// SIGTERM it stops workers with, and SIGKILL only before it sent one (`sent_kill`).
fn killed_from_outside(status: ExitStatus, sent_kill: bool) -> bool {
    use nix::sys::signal::Signal;
    use std::os::unix::process::ExitStatusExt;
    match status.signal().map(Signal::try_from) {
        Some(Ok(Signal::SIGTERM)) | None => false,
        Some(Ok(Signal::SIGKILL)) => !sent_kill,
        Some(_) => true,
    }
}

fn signal(w: &mut Running, s: nix::sys::signal::Signal) {
    if let Some(c) = &w.child {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(c.id() as i32), s);
    }
}

fn start(
    job: &Job,
    w: &mut Running,
    index: usize,
    world: u32,
    store: &str,
    tx: &mpsc::Sender<Event>,
) -> anyhow::Result<()> {
    let (program, rest) = job.cmd.split_first().context("no command given")?;
    let output = || {
        if job.prefix_output {
            Stdio::piped()
        } else {
            Stdio::inherit()
        }
    };
    let mut command = Command::new(program);
    command
        .args(rest)
        .envs(job.env.iter().cloned())
        .envs(environment(&w.slot, world, store, w.restarts))
        .stdin(Stdio::null())
        .stdout(output())
        .stderr(output());
    crate::orphan::die_with_parent(&mut command);
    let mut child = command.spawn().with_context(|| {
        format!(
            "cannot start `{}` for worker {}",
            program.to_string_lossy(),
            w.slot.name
        )
    })?;
    w.generation += 1;
    let prefix = format!("[{}]", w.slot.name);
    let out = child.stdout.take().map(|o| prefix_lines(o, prefix.clone(), false));
    let err = child.stderr.take().map(|e| prefix_lines(e, prefix, true));
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let (tx, generation) = (tx.clone(), w.generation);
    std::thread::spawn(move || {
        // Reap after the output is drained, so a worker's last lines come before its report.
        out.map(|t| t.join());
        err.map(|t| t.join());
        let status = loop {
            match nix::sys::wait::waitpid(pid, None) {
                Ok(s) => break wait_to_status(s),
                Err(nix::errno::Errno::EINTR) => continue,
                Err(_) => break None,
            }
        };
        if let Some(s) = status {
            let _ = tx.send(Event::Exited(index, generation, s));
        }
    });
    // The waiter thread reaps it; keep the handle only for its pid.
    w.child = Some(child);
    w.done = None;
    Ok(())
}

fn wait_to_status(s: nix::sys::wait::WaitStatus) -> Option<ExitStatus> {
    use std::os::unix::process::ExitStatusExt;
    match s {
        nix::sys::wait::WaitStatus::Exited(_, code) => Some(ExitStatus::from_raw((code & 0xff) << 8)),
        nix::sys::wait::WaitStatus::Signaled(_, sig, _) => Some(ExitStatus::from_raw(sig as i32)),
        _ => None,
    }
}

fn prefix_lines(r: impl Read + Send + 'static, prefix: String, stderr: bool) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let reader = BufReader::new(r);
        for line in reader.split(b'\n') {
            let Ok(line) = line else { break };
            let text = String::from_utf8_lossy(&line);
            if stderr {
                let _ = writeln!(std::io::stderr().lock(), "{prefix} {text}");
            } else {
                let _ = writeln!(std::io::stdout().lock(), "{prefix} {text}");
            }
        }
    })
}

fn forward_signals(tx: mpsc::Sender<Event>) -> anyhow::Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP])?;
    std::thread::spawn(move || {
        for s in signals.forever() {
            if tx.send(Event::Signal(s)).is_err() {
                return;
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_death_by_a_signal_we_did_not_send_is_a_cause() {
        use std::os::unix::process::ExitStatusExt;
        let killed = ExitStatus::from_raw(9); // SIGKILL
        let terminated = ExitStatus::from_raw(15); // SIGTERM: ours
        let segfault = ExitStatus::from_raw(11);
        let exit1 = ExitStatus::from_raw(1 << 8);
        assert!(killed_from_outside(killed, false));
        assert!(!killed_from_outside(killed, true), "after we sent SIGKILL, it is ours");
        assert!(!killed_from_outside(terminated, false));
        assert!(killed_from_outside(segfault, true));
        assert!(!killed_from_outside(exit1, false), "an exit code is no signal");
    }

    fn args(nproc: Option<u32>, roles: &[(&str, u32)]) -> LaunchArgs {
        LaunchArgs {
            nproc,
            roles: roles.iter().map(|(n, c)| (n.to_string(), *c)).collect(),
            max_restarts: 0,
            store: None,
            grace: 1.0,
            cmd: vec!["true".into()],
        }
    }

    #[test]
    fn roles_get_ranks_names_and_environment() {
        let s = slots(&args(None, &[("ps", 1), ("trainer", 2)])).unwrap();
        let names: Vec<_> = s.iter().map(|s| (s.name.as_str(), s.rank, s.role_rank)).collect();
        assert_eq!(names, vec![("ps0", 0, 0), ("trainer0", 1, 0), ("trainer1", 2, 1)]);
        let env = environment(&s[2], 3, "tcp://127.0.0.1:4000", 1);
        let get = |k: &str| env.iter().find(|(x, _)| x == k).map(|(_, v)| v.as_str());
        assert_eq!(get("RANK"), Some("2"));
        assert_eq!(get("WORLD_SIZE"), Some("3"));
        assert_eq!(get("ROLE_NAME"), Some("trainer"));
        assert_eq!(get("ROLE_RANK"), Some("1"));
        assert_eq!(get("ROLE_WORLD_SIZE"), Some("2"));
        assert_eq!(get("SLUICE_WORKER_NAME"), Some("trainer1"));
        assert_eq!(get("MASTER_ADDR"), Some("127.0.0.1"));
        assert_eq!(get("MASTER_PORT"), Some("4000"));
        assert_eq!(get("TORCHELASTIC_RESTART_COUNT"), Some("1"));
        let s = slots(&args(Some(2), &[])).unwrap();
        assert_eq!(s[1].name, "worker1");
    }

    #[test]
    fn bad_launch_arguments_are_refused() {
        assert!(slots(&args(None, &[])).is_err());
        assert!(slots(&args(None, &[("ps", 1), ("ps", 2)])).is_err());
        assert!(parse_role("ps").is_err());
        assert!(parse_role("ps=0").is_err());
        assert!(parse_role("ps2=1").is_err());
        assert!(parse_role("p s=1").is_err());
        assert_eq!(parse_role("trainer=4").unwrap(), ("trainer".to_owned(), 4));
    }
}
