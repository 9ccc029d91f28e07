//! Who holds a pipe's read role: the state and its transitions, without locks, threads or I/O
//! (the reader in [`crate::reader`] keeps one behind a mutex and acts on what comes back). `W`
//! names a waiting thread. Tested below by exploring every interleaving of two waiting
//! threads, the background reader and an awaiting task.
//!
//! Rules:
//! - at most one holder: a thread (leader), the background task, or nobody;
//! - the role is never free while a thread queues for it (`Free ⇒ no waiters`): giving it up
//!   hands it to the first waiter;
//! - the background task takes it only when it is free and nobody queues, and gives it up
//!   between messages when a thread queues;
//! - a thread handed the role after its result came in passes it straight on.

use std::collections::VecDeque;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Holder {
    Free,
    Background,
    Thread,
}

/// What a thread that wants its reply should do.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Ask {
    /// Read: the role is this thread's.
    Lead,
    /// Wait for the result or the hand-over; tell the background task to give way if it reads.
    Queued { give_way: bool },
    /// The pipe is gone.
    Ended,
}

/// Where the role goes when its holder gives it up.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Pass<W> {
    /// To this waiting thread (now the holder): wake it.
    To(W),
    /// To the background task: wake it.
    Resume,
    Nothing,
}

#[derive(Debug, Clone)]
pub(crate) struct Role<W> {
    pub(crate) holder: Holder,
    waiting: VecDeque<W>,
    /// The background task sleeps until woken or its tick.
    dormant: bool,
    /// A task awaits a reply while a thread reads: the background task takes over after it.
    awaited: bool,
    ended: bool,
}

impl<W: PartialEq> Role<W> {
    pub(crate) fn new() -> Self {
        Role {
            holder: Holder::Free,
            waiting: VecDeque::new(),
            dormant: false,
            awaited: false,
            ended: false,
        }
    }

    pub(crate) fn ended(&self) -> bool {
        self.ended
    }

    /// The role's state in words, for diagnostics.
    pub(crate) fn describe(&self) -> String {
        format!(
            "holder {:?}, {} waiting, dormant {}, awaited {}, ended {}",
            self.holder,
            self.waiting.len(),
            self.dormant,
            self.awaited,
            self.ended
        )
    }

    /// Thread `me` wants its reply read. `promoted`: the role was handed to it; `queued`:
    /// it is in the queue (updated here).
    pub(crate) fn ask(&mut self, me: W, promoted: bool, queued: &mut bool) -> Ask {
        if self.ended {
            return Ask::Ended;
        }
        if promoted {
            *queued = false;
            return Ask::Lead;
        }
        if self.holder == Holder::Free {
            self.holder = Holder::Thread;
            if *queued {
                self.waiting.retain(|w| *w != me);
                *queued = false;
            }
            return Ask::Lead;
        }
        if !*queued {
            self.waiting.push_back(me);
            *queued = true;
        }
        Ask::Queued {
            give_way: self.holder == Holder::Background,
        }
    }

    /// Thread `me` has its result (or gave up): it leaves the queue, and passes the role on if
    /// it had been handed it.
    pub(crate) fn leave(&mut self, me: &W, promoted: bool, queued: bool, wanted: impl FnOnce() -> bool) -> Pass<W> {
        if queued {
            self.waiting.retain(|w| w != me);
        }
        if promoted {
            self.release(wanted)
        } else {
            Pass::Nothing
        }
    }

    /// The holder gives the role up: to the first waiting thread, else to the background task
    /// if a task awaits a reply (`wanted`, asked only then: replies are still expected).
    pub(crate) fn release(&mut self, wanted: impl FnOnce() -> bool) -> Pass<W> {
        self.holder = Holder::Free;
        if self.ended {
            return Pass::Nothing;
        }
        if let Some(w) = self.waiting.pop_front() {
            self.holder = Holder::Thread;
            Pass::To(w)
        } else if self.dormant && std::mem::take(&mut self.awaited) && wanted() {
            Pass::Resume
        } else {
            Pass::Nothing
        }
    }

    /// The background task looks: takes the role if it is free and nobody queues (then it
    /// listens), else goes dormant. `None` once the pipe is gone.
    pub(crate) fn background_take(&mut self) -> Option<bool> {
        if self.ended {
            return None;
        }
        let take = self.holder == Holder::Free && self.waiting.is_empty();
        if take {
            self.holder = Holder::Background;
        }
        self.dormant = !take;
        Some(take)
    }

    /// After a message, whether the background task keeps the role (nobody queues for it).
    pub(crate) fn background_keeps(&self) -> bool {
        self.waiting.is_empty() && !self.ended
    }

    pub(crate) fn go_dormant(&mut self) {
        self.dormant = true;
    }

    /// A task awaits a reply: whether to wake the background task now.
    pub(crate) fn awaited(&mut self) -> bool {
        if !self.dormant || self.ended {
            return false;
        }
        if self.holder == Holder::Free {
            true
        } else {
            self.awaited = true;
            false
        }
    }

    /// The pipe failed: the role ends, and every waiting thread must be woken.
    pub(crate) fn end(&mut self) -> Option<VecDeque<W>> {
        if self.ended {
            return None;
        }
        self.ended = true;
        self.holder = Holder::Free;
        Some(std::mem::take(&mut self.waiting))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// One waiting thread, as the reader's `drive` runs it.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    enum T {
        /// Wants its reply; has not asked yet (or was woken and asks again).
        Asking {
            queued: bool,
        },
        /// Queued, asleep: woken by its result or the hand-over.
        Asleep,
        Leading,
        Done,
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    enum B {
        Dormant,
        Listening,
        /// Told to give way; gives the role up at its next step.
        GivingWay,
    }

    /// The whole system: the role, two threads (their result in or not, handed the role or
    /// not), the background task, and whether a task awaits a reply.
    #[derive(Debug, Clone)]
    struct World {
        role: Role<usize>,
        threads: [T; 2],
        result: [bool; 2],
        promoted: [bool; 2],
        queued: [bool; 2],
        bg: B,
        awaiting_task: bool,
        failed: bool,
    }

    type Key = (
        Holder,
        Vec<usize>,
        bool,
        bool,
        bool,
        [T; 2],
        [bool; 2],
        [bool; 2],
        [bool; 2],
        B,
        bool,
        bool,
    );

    impl World {
        fn key(&self) -> Key {
            (
                self.role.holder,
                self.role.waiting.iter().copied().collect(),
                self.role.dormant,
                self.role.awaited,
                self.role.ended,
                self.threads,
                self.result,
                self.promoted,
                self.queued,
                self.bg,
                self.awaiting_task,
                self.failed,
            )
        }

        /// Someone is reading, so a reply on the pipe gets delivered.
        fn reader_present(&self) -> bool {
            matches!(self.role.holder, Holder::Thread | Holder::Background)
        }

        fn deliver(&mut self, who: usize) {
            self.result[who] = true;
            if self.threads[who] == T::Asleep {
                self.threads[who] = T::Asking {
                    queued: self.queued[who],
                };
            }
        }

        fn pass(&mut self, p: Pass<usize>) {
            match p {
                Pass::To(w) => {
                    self.promoted[w] = true;
                    if self.threads[w] == T::Asleep {
                        self.threads[w] = T::Asking { queued: self.queued[w] };
                    }
                }
                Pass::Resume => {
                    if self.bg == B::Dormant {
                        self.bg = B::Listening;
                        self.role.background_take();
                        if self.role.holder != Holder::Background {
                            self.bg = B::Dormant;
                        }
                    }
                }
                Pass::Nothing => {}
            }
        }

        /// The worlds where the reader delivers one of the replies still outstanding.
        fn deliveries(&self) -> impl Iterator<Item = World> + '_ {
            (0..2)
                .filter(|&j| !self.result[j] && self.threads[j] != T::Done)
                .map(|j| {
                    let mut w = self.clone();
                    w.deliver(j);
                    w
                })
        }

        /// Every step the system can take from here.
        fn successors(&self) -> Vec<World> {
            let mut out = Vec::new();
            for i in 0..2 {
                match self.threads[i] {
                    T::Asking { .. } => {
                        let mut w = self.clone();
                        let promoted = std::mem::take(&mut w.promoted[i]);
                        if w.result[i] || w.role.ended() {
                            let queued = w.queued[i];
                            w.queued[i] = false;
                            let p = w.role.leave(&i, promoted, queued, || true);
                            w.pass(p);
                            w.threads[i] = T::Done;
                        } else {
                            let mut queued = w.queued[i];
                            match w.role.ask(i, promoted, &mut queued) {
                                Ask::Lead => w.threads[i] = T::Leading,
                                Ask::Queued { give_way } => {
                                    if give_way && w.bg == B::Listening {
                                        w.bg = B::GivingWay;
                                    }
                                    w.threads[i] = T::Asleep;
                                }
                                Ask::Ended => w.threads[i] = T::Done,
                            }
                            w.queued[i] = queued;
                        }
                        out.push(w);
                    }
                    T::Leading => {
                        // The leader reads its own reply (or the other's), or leaves with it.
                        out.extend(self.deliveries());
                        if self.result[i] {
                            let mut w = self.clone();
                            let p = w.role.release(|| true);
                            w.pass(p);
                            w.threads[i] = T::Done;
                            out.push(w);
                        }
                    }
                    T::Asleep | T::Done => {}
                }
            }
            // The background task.
            match self.bg {
                B::Dormant => {
                    // Its tick.
                    let mut w = self.clone();
                    if w.role.background_take() == Some(true) {
                        w.bg = B::Listening;
                    }
                    out.push(w);
                }
                B::Listening => {
                    out.extend(self.deliveries().map(|mut w| {
                        if !w.role.background_keeps() {
                            w.bg = B::GivingWay;
                        }
                        w
                    }));
                }
                B::GivingWay => {
                    let mut w = self.clone();
                    let p = w.role.release(|| true);
                    w.bg = B::Dormant;
                    w.role.go_dormant();
                    w.pass(p);
                    out.push(w);
                }
            }
            // A task starts awaiting a reply (once).
            if !self.awaiting_task {
                let mut w = self.clone();
                w.awaiting_task = true;
                if w.role.awaited() {
                    w.pass(Pass::Resume);
                }
                out.push(w);
            }
            // The pipe fails (once): every waiter is woken.
            if !self.failed {
                let mut w = self.clone();
                w.failed = true;
                if let Some(waiting) = w.role.end() {
                    for t in waiting {
                        if w.threads[t] == T::Asleep {
                            w.threads[t] = T::Asking { queued: false };
                        }
                        w.queued[t] = false;
                    }
                    for t in 0..2 {
                        if w.threads[t] == T::Leading {
                            w.threads[t] = T::Done;
                        }
                    }
                    w.bg = B::Dormant;
                }
                out.push(w);
            }
            out
        }

        fn check(&self) {
            assert!(
                self.role.holder != Holder::Free || self.role.waiting.is_empty(),
                "the role is free while a thread queues for it: {self:?}"
            );
            let leaders = self.threads.iter().filter(|t| **t == T::Leading).count();
            assert!(leaders <= 1, "two leaders: {self:?}");
            if leaders == 1 {
                assert_eq!(self.role.holder, Holder::Thread, "a leader without the role: {self:?}");
            }
            if self.bg == B::Listening {
                assert_eq!(
                    self.role.holder,
                    Holder::Background,
                    "listening without the role: {self:?}"
                );
            }
            if self.role.holder == Holder::Thread {
                let handed = self.promoted.iter().filter(|p| **p).count();
                assert!(
                    leaders + handed == 1,
                    "the role is a thread's but no single thread has it: {self:?}"
                );
            }
        }
    }

    #[test]
    fn every_interleaving_keeps_the_role_single_and_strands_nobody() {
        let start = World {
            role: Role::new(),
            threads: [T::Asking { queued: false }; 2],
            result: [false; 2],
            promoted: [false; 2],
            queued: [false; 2],
            bg: B::Dormant,
            awaiting_task: false,
            failed: false,
        };
        let mut seen = HashSet::new();
        let mut stack = vec![start];
        let mut finals = 0;
        while let Some(w) = stack.pop() {
            if !seen.insert(w.key()) {
                continue;
            }
            w.check();
            let next = w.successors();
            let all_done = w.threads.iter().all(|t| *t == T::Done);
            if all_done {
                finals += 1;
                assert!(
                    w.role.holder != Holder::Thread,
                    "every thread left, yet the role is a thread's: {w:?}"
                );
            } else {
                // Some thread still waits: something must be able to happen, and the
                // background task's tick alone must not be all there is while a thread
                // sleeps with nobody reading.
                assert!(!next.is_empty(), "stuck: {w:?}");
                let asleep_unread = w.threads.contains(&T::Asleep) && !w.reader_present() && !w.role.ended();
                assert!(!asleep_unread, "a thread sleeps and nobody reads: {w:?}");
            }
            stack.extend(next);
        }
        assert!(seen.len() > 100, "explored {} states", seen.len());
        assert!(finals > 0);
    }
}
