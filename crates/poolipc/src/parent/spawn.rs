//! Workers coming and going: spawning or accepting one (the handshake, the canary battery,
//! the pools offered), listing them, and stopping one.

use super::{Parent, Registered, Stats, Trust, WorkerInfo, WorkerPool, lock};
use std::collections::BTreeMap;
use std::os::fd::AsFd as _;
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use poolipc_contract::{ExtraPool, Message};
use poolipc_driver::PoolHandle;
use poolipc_transport::{Capabilities, Connection, HandshakeConfig};
use poolipc_types::WorkerId;

use crate::canary::CanaryReport;
use crate::driver_loop::Command as LoopCommand;
use crate::error::Error;

impl Parent {
    /// Spawns `cmd` as a worker on an inherited socketpair, shakes hands with it and runs the
    /// canary battery. The worker gets an id only if all of that got through: a worker that
    /// dies on the way is reaped and the error says what happened; one that exits before its
    /// handshake is [`Error::WorkerExited`], with its exit status and last lines on stderr.
    /// A worker whose canary battery fails is taken off pool pointers; if it offers no other
    /// rung (neither host staging nor the arena), it is stopped and the spawn is
    /// [`Error::NoRung`] with the battery's report.
    ///
    /// The worker's stderr is a pipe read by a thread of this process, which copies it to
    /// this process's stderr as it comes, a line at a time, each marked `[worker <pid>] `
    /// with its control characters replaced (`POOLIPC_WORKER_STDERR=raw` copies it as it
    /// is), and keeps its last few KiB for that report. The variables
    /// of [`Parent::on`]'s driver are set on `cmd`.
    ///
    /// The worker inherits this process's whole environment unless `cmd` was restricted
    /// first with [`restrict_env`](crate::restrict_env) (an
    /// allowlist; do that for workers you do not trust with your secrets). Of this process's
    /// descriptors it inherits its socket and its stdio only, whether or not the others were
    /// opened close-on-exec.
    ///
    /// The worker gets the parent's default trust, [`ParentOptions::isolated`]
    /// (see [`default_trust`](Parent::default_trust)); [`spawn_worker_with`](Parent::spawn_worker_with) chooses
    /// it for this worker alone.
    ///
    /// [`ParentOptions::isolated`]: crate::ParentOptions::isolated
    pub fn spawn_worker(&self, cmd: Command) -> Result<WorkerId, Error> {
        self.spawn_worker_with(cmd, self.default_trust())
    }

    /// As [`spawn_worker`](Parent::spawn_worker), with the worker's [`Trust`] chosen here
    /// instead of by [`ParentOptions::isolated`](crate::ParentOptions::isolated): an isolated
    /// and a trusted worker may serve one parent side by side. [`Parent::worker`] says which
    /// a worker is.
    pub fn spawn_worker_with(&self, mut cmd: Command, trust: Trust) -> Result<WorkerId, Error> {
        self.shared.check_loop()?;
        cmd.envs(self.worker_env.iter().map(|(k, v)| (k, v)))
            .stderr(std::process::Stdio::piped());
        let (mut child, conn) = poolipc_transport::spawn_worker(cmd)?;
        let pid = child.id();
        let tail = child
            .stderr
            .take()
            .map(|e| crate::handshake::StderrTail::start(e, pid));
        self.adopt(Some(child), conn, tail, trust)
    }

    /// Takes a worker connected by other means (a listening socket), and shakes hands; the
    /// worker gets `trust` ([`default_trust`](Parent::default_trust) is what
    /// [`spawn_worker`](Parent::spawn_worker)'s workers get).
    pub fn accept_worker(&self, conn: Connection, trust: Trust) -> Result<WorkerId, Error> {
        self.shared.check_loop()?;
        self.adopt(None, conn, None, trust)
    }

    /// The trust a worker spawned or accepted without a choice of its own gets:
    /// [`ParentOptions::isolated`](crate::ParentOptions::isolated)'s.
    pub fn default_trust(&self) -> Trust {
        Trust::default_of(self.shared.options.isolated)
    }

    fn adopt(
        &self,
        mut child: Option<Child>,
        mut conn: Connection,
        tail: Option<crate::handshake::StderrTail>,
        trust: Trust,
    ) -> Result<WorkerId, Error> {
        let kill = |child: &mut Option<Child>| {
            if let Some(c) = child.as_mut() {
                let _ = c.kill();
                let _ = c.wait();
            }
        };
        if let Err(e) = self
            .shared
            .check_loop()
            .and_then(|()| self.shared.check_context())
        {
            kill(&mut child);
            return Err(e);
        }
        let deadline = Instant::now() + self.shared.options.handshake_timeout;
        let isolated = trust.is_isolated();
        let setup = self.identity().and_then(|mut identity| {
            let first = self.shared.pools[0].handle();
            if isolated {
                // No handle on the pool: pointers and VMM handles are not on offer, and the
                // descriptor Hello carries is an empty sealed memfd, not the pool's FD.
                identity.capabilities = identity
                    .capabilities
                    .missing_from(crate::settings::PARENT_MEMORY_HANDLES);
                let config = HandshakeConfig {
                    identity,
                    required: Capabilities::NONE,
                };
                let stand_in = no_pool_fd()?;
                let peer = poolipc_transport::parent_handshake(
                    &mut conn,
                    &config,
                    stand_in.as_fd(),
                    deadline,
                )?;
                return Ok((peer, first, Vec::new()));
            }
            let config = HandshakeConfig {
                identity,
                required: Capabilities::NONE,
            };
            let fd = self.shared.pools[0]
                .fd_of(first)
                .ok_or_else(|| Error::Protocol("the parent's pool has no FD".into()))?;
            let peer =
                poolipc_transport::parent_handshake(&mut conn, &config, fd.as_fd(), deadline)?;
            let more = self.offer_more_pools(&mut conn, first, deadline)?;
            Ok((peer, first, more))
        });
        let (peer, first, more) = match setup {
            Ok(s) => s,
            Err(e) => {
                // A worker that hung up has most likely exited, or is about to: its status
                // and its last words say why, where "peer is gone" does not.
                let exited = child.as_mut().and_then(|c| {
                    let until = Instant::now() + Duration::from_millis(300);
                    loop {
                        match c.try_wait() {
                            Ok(Some(status)) => return Some(status),
                            Ok(None) if Instant::now() < until => {
                                std::thread::sleep(Duration::from_millis(5));
                            }
                            _ => return None,
                        }
                    }
                });
                kill(&mut child);
                // A refusal says why by itself (and callers match on it); a hang-up does not.
                let hung_up = matches!(
                    e,
                    Error::Transport(_)
                        | Error::Handshake(poolipc_transport::HandshakeError::Transport(_))
                );
                return Err(match (exited, tail) {
                    (Some(status), Some(tail)) if hung_up => Error::WorkerExited {
                        status: status.to_string(),
                        stderr: tail.last_lines(Duration::from_millis(500)),
                        during: Box::new(e),
                    },
                    _ => e,
                });
            }
        };
        let id = WorkerId(self.shared.next_worker.fetch_add(1, Ordering::Relaxed));
        let pid = child.as_ref().map(Child::id);
        let reaches_first = !isolated
            && peer
                .identity
                .capabilities
                .contains(Capabilities::POOL_POINTER);
        let mut pools = BTreeMap::new();
        pools.insert(
            0,
            WorkerPool {
                handle: first,
                reachable: reaches_first,
                retiring: false,
            },
        );
        pools.extend(more);
        let info = WorkerInfo {
            id,
            pid,
            identity: peer.identity,
            trust,
        };
        if let (Some(sim), Some(pid)) = (&self.shared.sim, pid) {
            sim.name(pid, &format!("worker {}", id.0));
        }
        lock(&self.shared.registry).insert(
            id,
            Registered {
                info,
                canary: None,
                pools,
                reaches_first,
            },
        );
        let (tx, rx) = std::sync::mpsc::channel();
        self.shared.post(LoopCommand::Adopt {
            worker: id,
            conn: Box::new(conn),
            child,
            reply: tx,
        });
        let adopted = rx
            .recv()
            .map_err(|_| self.shared.loop_gone())
            .and_then(|r| r);
        if let Err(e) = adopted {
            lock(&self.shared.registry).remove(&id);
            return Err(e);
        }
        tracing::info!(worker = %id, ?pid, %trust, "worker connected");
        if isolated {
            tracing::info!(
                worker = %id,
                "the worker is isolated: its tensors cross by arena copy, its results come from its own arena chunks"
            );
        } else if !reaches_first {
            tracing::warn!(
                worker = %id,
                "the worker cannot reach the pool from its device: its tensors take host staging"
            );
        } else if self.shared.options.canary {
            let report = match super::canary::run(self, id) {
                Ok(r) => r,
                Err(e) => {
                    let _ = self.stop_worker(id);
                    return Err(e);
                }
            };
            if !report.ok() && !self.has_another_rung(id) {
                let _ = self.stop_worker(id);
                return Err(Error::NoRung(format!(
                    "none is left for {id}: it failed its canary battery ({report}), which \
                     takes it off pool pointers, and offers neither host staging nor the arena"
                )));
            }
            if let Some(r) = lock(&self.shared.registry).get_mut(&id) {
                r.canary = Some(report);
            }
        }
        if self.shared.registered(id).is_none() {
            let _ = self.stop_worker(id);
            let when = if reaches_first && self.shared.options.canary {
                "during its canary battery"
            } else {
                "right after its handshake"
            };
            return Err(Error::Protocol(format!("{id} was lost {when}")));
        }
        Stats::bump(&self.shared.stats.workers_connected);
        Ok(id)
    }

    /// Whether worker `id` can take a tensor by another rung than the pool pointer: host
    /// staging, or the arena (results or copies) where this parent keeps one.
    fn has_another_rung(&self, id: WorkerId) -> bool {
        let arena_on = matches!(
            self.shared.options.results,
            crate::state::ResultMemory::Arena { .. }
        ) || self.shared.options.arena_copy;
        self.shared.registered(id).is_some_and(|r| {
            let caps = r.info.identity.capabilities;
            caps.contains(Capabilities::HOST_STAGING)
                || (arena_on && caps.contains(Capabilities::VMM_ARENA))
        })
    }

    /// Offers a new worker every live pool generation but `first` (the Hello pool), one
    /// `ExtraPool` each at indices 1, 2, ..., and returns its table entries.
    fn offer_more_pools(
        &self,
        conn: &mut Connection,
        first: PoolHandle,
        deadline: Instant,
    ) -> Result<Vec<(u8, WorkerPool)>, Error> {
        let mut table = Vec::new();
        let generations = self.shared.pools.iter().flat_map(|pool| {
            pool.handles()
                .into_iter()
                .filter(|h| *h != first)
                .map(move |h| (pool, h))
        });
        for (i, (pool, handle)) in generations.enumerate() {
            let index = u8::try_from(i + 1)
                .map_err(|_| Error::Config("more than 255 pool generations".into()))?;
            let device = self.shared.driver.device_info(pool.device())?.uuid;
            // Retired meanwhile and destroyed: nothing of it can be lent any more.
            let Some(fd) = pool.fd_of(handle) else {
                continue;
            };
            conn.send(
                &Message::ExtraPool(ExtraPool { index, device }),
                &[fd.as_fd()],
                deadline,
            )?;
            match conn.recv(deadline)? {
                (Message::ExtraPoolReply(r), _) if r.index == index => {
                    if !r.reachable {
                        tracing::info!(
                            pool_device = pool.device(),
                            reason = %poolipc_contract::worker_text(&r.reason),
                            "the worker cannot use this pool: its tensors go by host staging"
                        );
                    }
                    table.push((
                        index,
                        WorkerPool {
                            handle,
                            reachable: r.reachable,
                            retiring: false,
                        },
                    ));
                }
                (other, _) => {
                    return Err(Error::Protocol(format!(
                        "expected the answer to ExtraPool {index}, got {}",
                        other.kind()
                    )));
                }
            }
        }
        Ok(table)
    }

    /// What the parent knows of a worker (never waits for a job).
    pub fn worker(&self, id: WorkerId) -> Option<WorkerInfo> {
        self.shared.registered(id).map(|r| r.info)
    }

    /// Every live worker.
    pub fn workers(&self) -> Vec<WorkerInfo> {
        lock(&self.shared.registry)
            .values()
            .map(|r| r.info.clone())
            .collect()
    }

    /// The canary battery's report on a worker, if it ran.
    pub fn canary_report(&self, id: WorkerId) -> Option<CanaryReport> {
        self.shared.registered(id).and_then(|r| r.canary)
    }

    /// Tells the worker to stop (Bye), waits for it to exit at most `options.stop_timeout`,
    /// then kills it, and reaps it. Jobs it still held fail. Never waits for other workers'
    /// jobs.
    pub fn stop_worker(&self, worker: WorkerId) -> Result<Option<ExitStatus>, Error> {
        self.shared.check_loop()?;
        if self.shared.registered(worker).is_none() {
            return Err(Error::UnknownWorker(worker));
        }
        let (tx, rx) = std::sync::mpsc::channel();
        self.shared.post(LoopCommand::Stop { worker, reply: tx });
        let status = rx.recv().map_err(|_| self.shared.loop_gone())?;
        lock(&self.shared.registry).remove(&worker);
        status
    }
}

/// What an isolated worker's `Hello` carries where the pool's FD would be: an empty memfd,
/// sealed against growing, so that the frame keeps its one descriptor and the worker gets no
/// handle on the parent's memory.
fn no_pool_fd() -> Result<std::os::fd::OwnedFd, Error> {
    use nix::sys::memfd::{MFdFlags, memfd_create};
    let fd = memfd_create(
        c"poolipc-no-pool",
        MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
    )
    .map_err(|e| Error::Os {
        call: "memfd_create (an isolated worker's stand-in for the pool FD)",
        source: e.into(),
    })?;
    nix::fcntl::fcntl(
        &fd,
        nix::fcntl::FcntlArg::F_ADD_SEALS(
            nix::fcntl::SealFlag::F_SEAL_GROW
                | nix::fcntl::SealFlag::F_SEAL_SHRINK
                | nix::fcntl::SealFlag::F_SEAL_WRITE
                | nix::fcntl::SealFlag::F_SEAL_SEAL,
        ),
    )
    .map_err(|e| Error::Os {
        call: "fcntl(F_ADD_SEALS) of an isolated worker's stand-in for the pool FD",
        source: e.into(),
    })?;
    Ok(fd)
}
