//! A worker that shakes hands properly, then breaks the protocol in the way
//! `POOLIPC_TEST_ROGUE` names, so the tests can show that every fault takes the lost-worker
//! path. It speaks the wire by hand (the transport and the contract's messages); it imports
//! nothing. Modes, each acting on the first job's `Lend`:
//!
//! - `bad-request-len`: a result request whose byte length does not match its shape;
//! - `done-other-job`: a DONE for a job it was never given;
//! - `ack-before-done`: an ACK of the job's handles with no DONE before it;
//! - `second-hello-ack`: a second `HelloAck`;
//! - `garbage-frame`: bytes that are no frame at all;
//! - `exit-on-first-job`: exits at once (with the canary battery on, during it);
//! - `silent`: nothing at all (the handoff deadline must end it);
//! - `ignore-bye`: answers nothing and ignores `Bye` (the stop deadline must end it);
//! - `arena-ack-before-done`: announces the result arena, asks for one result, takes the
//!   arena grant, then ACKs the job with no DONE before it (it maps nothing: it never
//!   writes).
//! - `arena-carve-out-of-bounds`, `arena-carve-overlap`, `arena-carve-misaligned`: takes the
//!   job's arena slice (the parent must lend one) and sends a `Done` naming carves out of it
//!   that lie past its end, overlap, or start off the 512-byte alignment.
//! - `results-too-many`: asks for 5000 results in one request (more than a grant may carry);
//!   checks that every one is refused with `ErrorCode::LIMIT`, then fails the job with that
//!   refusal's text and finishes it properly (a DONE event of its own, then the ACK); exits
//!   at the parent's `Bye`.
//! - `results-flood`: asks for 4096 one-byte results per request, again after each grant,
//!   never finishing the job (the results-per-job bound must end it).
//! - `giant-result`, `arena-giant-result` (the latter announces the arena): asks for one
//!   result of `POOLIPC_TEST_ROGUE_BYTES` bytes (1 TiB by default). Refused, it fails the job
//!   with the refusal's text and finishes it properly, then waits for `Bye`; granted, it
//!   exits with an error (the parent must refuse, or condemn it first).
//! - `keep-alive`: answers the job with an empty result request every 100 ms, forever: each
//!   one is a valid message about the job, and none is progress (the bound on messages
//!   without progress must end it).
//! - `empty-done`: answers the job with a `Done` naming no handoff every 100 ms, forever (the
//!   first is progress, the rest are not).
//! - `job-error-drip`: a `JobError` about the job every 500 ms, forever (only the first is
//!   progress: the handoff deadline must end it).
//! - `ignore-cancel`: asks for one 4 KiB result every 200 ms, forever, whatever the parent
//!   answers, and ignores the parent's `Cancel` (the cancel grace must end it).
//! - `results-hog`: announces the arena; asks for one result of `POOLIPC_TEST_ROGUE_BYTES`
//!   bytes (1 GiB by default) at a time, again after each grant, and never finishes the job
//!   (the result bytes bounds must end it).
//! - `long-job`: announces long jobs (`Capabilities::LONG_JOBS`); at its first `Lend` it
//!   "computes" for `POOLIPC_TEST_ROGUE_DELAY_MS` (0: for ever), sending a `Heartbeat`
//!   every 200 ms meanwhile, then finishes the job properly (a DONE event of its own, the
//!   `Done` naming every handoff, the `Ack`) and waits for `Bye`.
//! - `done-churn`: serves every job properly but with a DONE event of its own each time
//!   (created, recorded, its blob sent; destroyed 64 jobs later, since libcuda hands a new
//!   event the blob of one just destroyed): the parent must not keep every blob it was
//!   sent open. Exits at the parent's `Bye`.
//! - `staging-flood`: offers no pool pointers (so the parent stages); when the staging
//!   buffer arrives it never says `StagingReady` but sends result requests of 4096 results
//!   each, as fast as it can, until the parent closes the connection (the staging backlog's
//!   bound must end it).
//! - `staging-ftruncate`: offers no pool pointers (so the parent stages), and when the
//!   staging buffer arrives tries to `ftruncate` its memfd to 0 bytes, says
//!   `StagingReady`, waits for the parent's first chunk (which the parent wrote into the
//!   buffer: a truncated file would have been a `SIGBUS` in the parent), then exits.
//! - `staging-slow`: offers no pool pointers (so the parent stages); says `StagingReady`
//!   when the staging buffer arrives, then acks each chunk of the parent's
//!   `POOLIPC_TEST_ROGUE_DELAY_MS` after it came (300 by default), without copying it out;
//!   it never runs a job. Exits at the parent's `Bye`.
//! - `staging-late-ready`: as `staging-slow`, but it says `StagingReady`
//!   `POOLIPC_TEST_ROGUE_DELAY_MS` after the staging buffer came (300 by default) and acks
//!   each chunk at once.
//! - `staging-late-result`: as `staging-late-ready`, but what needs host staging is a result:
//!   at its first `Lend` (a job without staged inputs) it asks for one 4 KiB result, which
//!   the parent can only give by host staging (no pool pointers, no arena); it then answers
//!   the staging setup late as `staging-late-ready` does, and never finishes the job.
//! - `staging-gpu-hang`: offers no pool pointers (so the parent stages); when the staging
//!   buffer arrives it starts a helper process of its own (`staging-hang-recorder`, stdio
//!   not inherited) that records the first half's `drained` event behind a kernel that never
//!   ends (`launch_hang_kernel`), then says `StagingReady` and acks chunks at once: the
//!   parent's transfer waits on the host for that record, which does not complete even once
//!   this process is killed (the helper lives on 5 s after it, as a CUDA record behind a
//!   hung kernel never completes; the simulation ends a dead process's records; it then
//!   kills itself, as a plain exit would wait for the hung kernel). Exits at the parent's
//!   `Bye`.
//! - `slow-frames`: 200 ms after the handshake, valid `Heartbeat` frames, each one's header
//!   now and the rest `POOLIPC_TEST_ROGUE_DELAY_MS` later (1000 by default), one after
//!   another, forever; it never reads.
//! - `never-read`: reads nothing after the handshake (the parent's frames pile up).
//! - `canary-fail`: serves every job by the protocol (results asked for and granted, DONE,
//!   ACK) but writes nothing, so its canary battery fails; with `POOLIPC_TEST_ROGUE_STAGING`
//!   set it offers host staging too, with `POOLIPC_TEST_ROGUE_EXTRA` set it asks for one
//!   result more than each job has inputs. Exits at the parent's `Bye`.
//! - `heartbeat-flood`: valid `Heartbeat` frames as fast as the socket takes them, forever;
//!   it never reads.
//! - `pool-thief`: claims pool pointers, then takes the descriptor the parent's `Hello`
//!   carried for the pool and imports it as a pool (`cuMemPoolImportFromShareableHandle`);
//!   with a pool, imports the export of every tensor of the first `Lend` through it. Writes
//!   what happened to `POOLIPC_TEST_REPORT` (`pool: imported`, or `pool: refused: <why>`, and
//!   `pointers: <n> imported`), then exits. An isolated worker's parent must give it nothing
//!   to import.
//! - `fd-drip`: 200 ms after the handshake, a valid 1 KiB `JobError` frame one byte at a
//!   time, 1 ms apart, each byte carrying a descriptor (of `/dev/null`); it never reads.
//! - `arena-snoop`: announces the arena and maps every arena chunk it is sent, read-write,
//!   as a worker does. At its first job it waits on the job's READY events, reads every
//!   chunk it mapped through its own mappings, counting the 4-byte words equal to each
//!   pattern of `POOLIPC_TEST_ROGUE_PATTERNS` (hex, comma-separated), then overwrites every
//!   chunk with `0xEE`. It fails the job with a report,
//!   `arena-snoop: chunks <index>:<len>,...; found <pattern>=<words>,...; overwrote <bytes>`,
//!   finishes it properly (its DONE after the overwrite) and waits for `Bye`.
//! - `chaos`: a seeded random walk over everything a worker can send, mixed with honest
//!   answers (`poolipc_tests::chaos`): `POOLIPC_TEST_ROGUE_SEED` (0 by default) and
//!   `POOLIPC_TEST_ROGUE_STEPS` (300); the pool pointer, the arena and host staging each
//!   offered or not as the seed says. It prints how it ended and exits 0.
//! - `chaos-hello`: lies through the handshake as the seed says (`chaos::hello`: a random
//!   identity, another message, no frame, a refusal, silence, an exit, or the truth); where
//!   the parent accepts, walks on as `chaos` does (100 steps by default).

use std::io::Write as _;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use poolipc::advanced::contract::{Ack, CarvedResult, Done, Message, ResultRequest, ResultSpec};
use poolipc::advanced::driver::{Driver, OwnedEvent, OwnedStream};
use poolipc::advanced::transport::{Capabilities, HandshakeConfig};
use poolipc::advanced::types::{DType, EventBlob, JobId};

fn run() -> anyhow::Result<()> {
    poolipc_tests::init_tracing();
    let mode = std::env::var("POOLIPC_TEST_ROGUE")?;
    let driver: Arc<dyn Driver> = match poolipc::advanced::driver::sim::SimDriver::from_env() {
        Some(sim) => Arc::new(sim?),
        None => Arc::new(poolipc::advanced::driver::CudaDriver::new()?),
    };
    if mode == "staging-hang-recorder" {
        return staging_hang_recorder(&driver);
    }
    let mut conn = poolipc::advanced::transport::connection_from_env()?;
    let mut caps = Capabilities(Capabilities::POOL_POINTER.0 | Capabilities::IPC_EVENTS.0);
    if mode.starts_with("arena-") || mode == "results-flood" || mode == "results-hog" {
        caps = caps | Capabilities::VMM_ARENA;
    }
    if mode == "long-job" {
        caps = caps | Capabilities::LONG_JOBS;
    }
    if mode.starts_with("staging-") {
        caps = Capabilities(Capabilities::IPC_EVENTS.0 | Capabilities::HOST_STAGING.0);
    }
    if mode == "canary-fail" && std::env::var_os("POOLIPC_TEST_ROGUE_STAGING").is_some() {
        caps = caps | Capabilities::HOST_STAGING;
    }
    let seed: u64 = env_or("POOLIPC_TEST_ROGUE_SEED", 0)?;
    if mode == "chaos" || mode == "chaos-hello" {
        // Every seed offers IPC events; the rest as the seed says (at least one rung).
        caps = Capabilities(
            Capabilities::IPC_EVENTS.0
                | match poolipc_tests::chaos::Rng::new(seed ^ 0xC4A05).below(4) {
                    0 => Capabilities::POOL_POINTER.0,
                    1 => Capabilities::POOL_POINTER.0 | Capabilities::VMM_ARENA.0,
                    2 => Capabilities::HOST_STAGING.0,
                    _ => {
                        Capabilities::POOL_POINTER.0
                            | Capabilities::VMM_ARENA.0
                            | Capabilities::HOST_STAGING.0
                    }
                },
        );
    }
    let config = HandshakeConfig {
        identity: poolipc::advanced::identity(&*driver, 0, caps)?,
        required: Capabilities::NONE,
    };
    let deadline = || Instant::now() + Duration::from_secs(30);
    if mode == "chaos-hello" {
        let steps = env_or("POOLIPC_TEST_ROGUE_STEPS", 100)?;
        let Some((conn, identity)) = poolipc_tests::chaos::hello(conn, &config.identity, seed)?
        else {
            eprintln!("poolipc-test-rogue: chaos-hello seed {seed}: the handshake ended");
            return Ok(());
        };
        let (ending, sent) = poolipc_tests::chaos::run(conn, &*driver, identity, seed, steps)?;
        eprintln!("poolipc-test-rogue: chaos-hello seed {seed}: {ending:?} after {sent} frames");
        return Ok(());
    }
    let (_peer, pool_fd) =
        poolipc::advanced::transport::worker_handshake(&mut conn, &config, deadline())?;
    if mode == "pool-thief" {
        return pool_thief(&driver, conn, &pool_fd);
    }
    if mode == "chaos" {
        let steps = env_or("POOLIPC_TEST_ROGUE_STEPS", 300)?;
        let (ending, sent) =
            poolipc_tests::chaos::run(conn, &*driver, config.identity, seed, steps)?;
        eprintln!("poolipc-test-rogue: chaos seed {seed}: {ending:?} after {sent} frames");
        return Ok(());
    }
    match mode.as_str() {
        "slow-frames" => return slow_frames(conn),
        "never-read" => {
            std::thread::sleep(Duration::from_secs(600));
            return Ok(());
        }
        "fd-drip" => return fd_drip(conn),
        "canary-fail" => return canary_fail(conn, &*driver),
        "heartbeat-flood" => {
            // Valid frames as fast as the socket takes them, until the parent lets go.
            let mut conn = conn;
            let mut sent = 0u64;
            while conn
                .send(&Message::Heartbeat { seq: sent }, &[], deadline())
                .is_ok()
            {
                sent += 1;
            }
            eprintln!("poolipc-test-rogue: the parent let go after {sent} heartbeats");
            return Ok(());
        }
        "arena-snoop" => return arena_snoop(conn, driver),
        _ => {}
    }
    if mode == "ignore-bye" {
        loop {
            // Read and drop everything, Bye included; never exit.
            if conn.recv(deadline()).is_err() {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
    if mode == "staging-flood" {
        loop {
            match conn.recv(deadline())?.0 {
                Message::StagingBuffer(_) => break,
                Message::Heartbeat { .. } | Message::ArenaChunk(_) => {}
                other => anyhow::bail!("rogue: expected a StagingBuffer, got {}", other.kind()),
            }
        }
        let flood = Message::ResultRequest(ResultRequest {
            job: JobId(1),
            results: vec![
                ResultSpec {
                    dtype: DType::U8,
                    shape: vec![1],
                    byte_len: 1,
                };
                poolipc::advanced::contract::MAX_RESULTS_PER_REQUEST
            ],
        });
        let mut sent = 0u64;
        loop {
            if let Err(e) = conn.send(&flood, &[], deadline()) {
                eprintln!(
                    "poolipc-test-rogue: the parent stopped reading after {sent} frames: {e}"
                );
                return Ok(());
            }
            sent += 1;
        }
    }
    if mode == "staging-slow" || mode == "staging-late-ready" || mode == "staging-late-result" {
        return staging_slow(conn, mode != "staging-slow", mode == "staging-late-result");
    }
    if mode == "staging-gpu-hang" {
        return staging_gpu_hang(conn);
    }
    if mode == "staging-ftruncate" {
        let (bytes, fd) = loop {
            match conn.recv(deadline())? {
                (Message::StagingBuffer(b), mut fds) if fds.len() == 1 => {
                    break (b.bytes, fds.remove(0));
                }
                (Message::Heartbeat { .. } | Message::ArenaChunk(_), _) => {}
                (other, _) => {
                    anyhow::bail!("rogue: expected a StagingBuffer, got {}", other.kind())
                }
            }
        };
        match nix::unistd::ftruncate(&fd, 0) {
            Ok(()) => eprintln!("poolipc-test-rogue: ftruncate of the staging memfd worked"),
            Err(e) => eprintln!("poolipc-test-rogue: ftruncate of the staging memfd refused: {e}"),
        }
        conn.send(&Message::StagingReady { bytes }, &[], deadline())?;
        loop {
            match conn.recv(deadline())?.0 {
                Message::Chunk(_) => std::process::exit(4),
                Message::Heartbeat { .. } | Message::ArenaChunk(_) | Message::Lend(_) => {}
                other => anyhow::bail!("rogue: expected a Chunk, got {}", other.kind()),
            }
        }
    }
    if mode == "done-churn" {
        driver.use_device(0)?;
        // Its events in a ring larger than any bound a test sets (`DoneRing`): the parent
        // sees `DONE_RING` distinct blobs.
        let mut events = poolipc_tests::chaos::DoneRing::new(&*driver);
        loop {
            let lend = match conn.recv(Instant::now() + Duration::from_secs(600))?.0 {
                Message::Lend(l) => l,
                Message::Bye => return Ok(()),
                _ => continue,
            };
            let handles: Vec<_> = lend.tensors.iter().map(|t| t.handle).collect();
            let done_event = events.record()?;
            poolipc_tests::chaos::send_done_and_ack(
                &mut conn,
                lend.job,
                done_event,
                handles,
                deadline(),
            )?;
        }
    }
    let lend = loop {
        match conn.recv(deadline())?.0 {
            Message::Lend(l) => break l,
            Message::Heartbeat { .. } | Message::ArenaChunk(_) => {}
            other => anyhow::bail!("rogue: expected a Lend, got {}", other.kind()),
        }
    };
    let handles: Vec<_> = lend.tensors.iter().map(|t| t.handle).collect();
    let bad = match mode.as_str() {
        "bad-request-len" => Message::ResultRequest(ResultRequest {
            job: lend.job,
            results: vec![ResultSpec {
                dtype: DType::F32,
                shape: vec![16],
                byte_len: 65,
            }],
        }),
        "done-other-job" => Message::Done(Done {
            job: JobId(lend.job.0 + 1000),
            done_event: EventBlob([7; 64]),
            handles,
            carved: Vec::new(),
        }),
        "ack-before-done" => Message::Ack(Ack {
            job: lend.job,
            handles,
        }),
        "second-hello-ack" => Message::HelloAck(config.identity.clone()),
        "results-flood" => {
            let spec = ResultSpec {
                dtype: DType::U8,
                shape: vec![1],
                byte_len: 1,
            };
            loop {
                conn.send(
                    &Message::ResultRequest(ResultRequest {
                        job: lend.job,
                        results: vec![
                            spec.clone();
                            poolipc::advanced::contract::MAX_RESULTS_PER_REQUEST
                        ],
                    }),
                    &[],
                    deadline(),
                )?;
                recv_grant(&mut conn)?;
            }
        }
        "giant-result" | "arena-giant-result" => {
            let bytes: u64 = match std::env::var("POOLIPC_TEST_ROGUE_BYTES") {
                Ok(v) => v.parse()?,
                Err(_) => 1 << 40,
            };
            conn.send(
                &Message::ResultRequest(ResultRequest {
                    job: lend.job,
                    results: vec![ResultSpec {
                        dtype: DType::U8,
                        shape: vec![bytes],
                        byte_len: bytes,
                    }],
                }),
                &[],
                deadline(),
            )?;
            let grant = recv_grant(&mut conn)?;
            let said = match grant.results.as_slice() {
                [poolipc::advanced::contract::ResultGrant::Refused { code, message }] => {
                    format!("refused with {code}: {message}")
                }
                other => anyhow::bail!("rogue: a result of {bytes} bytes was granted: {other:?}"),
            };
            return finish_failed(&mut conn, &*driver, lend.job, handles, said);
        }
        "empty-done" => loop {
            conn.send(
                &Message::Done(Done {
                    job: lend.job,
                    done_event: EventBlob([7; 64]),
                    handles: Vec::new(),
                    carved: Vec::new(),
                }),
                &[],
                deadline(),
            )?;
            std::thread::sleep(Duration::from_millis(100));
        },
        "job-error-drip" => loop {
            conn.send(
                &Message::JobError {
                    job: lend.job,
                    message: "still failing".into(),
                },
                &[],
                deadline(),
            )?;
            std::thread::sleep(Duration::from_millis(500));
        },
        "ignore-cancel" => {
            let mut granted = 0u32;
            let mut refused = 0u32;
            loop {
                conn.send(
                    &Message::ResultRequest(ResultRequest {
                        job: lend.job,
                        results: vec![ResultSpec {
                            dtype: DType::U8,
                            shape: vec![4096],
                            byte_len: 4096,
                        }],
                    }),
                    &[],
                    deadline(),
                )?;
                let grant = loop {
                    match conn.recv(deadline())?.0 {
                        Message::AllocationGrant(g) => break g,
                        Message::Heartbeat { .. } | Message::ArenaChunk(_) => {}
                        Message::Cancel { .. } => {
                            eprintln!("poolipc-test-rogue: cancelled; asking on");
                        }
                        other => anyhow::bail!("rogue: expected a grant, got {}", other.kind()),
                    }
                };
                for g in &grant.results {
                    match g {
                        poolipc::advanced::contract::ResultGrant::Refused { .. } => refused += 1,
                        _ => granted += 1,
                    }
                }
                eprintln!("poolipc-test-rogue: {granted} granted, {refused} refused");
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        "results-hog" => {
            let bytes = env_or("POOLIPC_TEST_ROGUE_BYTES", 1 << 30)?;
            let mut held = 0u64;
            loop {
                conn.send(
                    &Message::ResultRequest(ResultRequest {
                        job: lend.job,
                        results: vec![ResultSpec {
                            dtype: DType::U8,
                            shape: vec![bytes],
                            byte_len: bytes,
                        }],
                    }),
                    &[],
                    deadline(),
                )?;
                let grant = recv_grant(&mut conn)?;
                if !matches!(
                    grant.results.as_slice(),
                    [poolipc::advanced::contract::ResultGrant::Refused { .. }]
                ) {
                    held += bytes;
                }
                eprintln!("poolipc-test-rogue: holding {held} result bytes");
            }
        }
        "long-job" => {
            let compute = env_or("POOLIPC_TEST_ROGUE_DELAY_MS", 0)?;
            let until = (compute > 0).then(|| Instant::now() + Duration::from_millis(compute));
            let mut seq = 0;
            while until.is_none_or(|u| Instant::now() < u) {
                conn.send(&Message::Heartbeat { seq }, &[], deadline())?;
                seq += 1;
                std::thread::sleep(Duration::from_millis(200));
            }
            driver.use_device(0)?;
            let event = OwnedEvent::new(Arc::clone(&driver), true)?.into_raw();
            driver.event_record(event, poolipc::StreamHandle::NULL)?;
            let done_event = driver.ipc_get_event_handle(event)?;
            poolipc_tests::chaos::send_done_and_ack(
                &mut conn,
                lend.job,
                done_event,
                handles,
                deadline(),
            )?;
            loop {
                match conn.recv(Instant::now() + Duration::from_secs(600))?.0 {
                    Message::Bye => return Ok(()),
                    _ => continue,
                }
            }
        }
        "keep-alive" => loop {
            conn.send(
                &Message::ResultRequest(ResultRequest {
                    job: lend.job,
                    results: Vec::new(),
                }),
                &[],
                deadline(),
            )?;
            recv_grant(&mut conn)?;
            std::thread::sleep(Duration::from_millis(100));
        },
        "results-too-many" => {
            let spec = ResultSpec {
                dtype: DType::U8,
                shape: vec![1],
                byte_len: 1,
            };
            conn.send(
                &Message::ResultRequest(ResultRequest {
                    job: lend.job,
                    results: vec![spec; 5000],
                }),
                &[],
                deadline(),
            )?;
            let grant = loop {
                match conn.recv(deadline())?.0 {
                    Message::AllocationGrant(g) => break g,
                    Message::Heartbeat { .. } | Message::ArenaChunk(_) => {}
                    other => anyhow::bail!("rogue: expected a grant, got {}", other.kind()),
                }
            };
            let mut said = None;
            for g in &grant.results {
                match g {
                    poolipc::advanced::contract::ResultGrant::Refused { code, message }
                        if *code == poolipc::advanced::contract::ErrorCode::LIMIT =>
                    {
                        said.get_or_insert_with(|| format!("refused with {code}: {message}"));
                    }
                    other => anyhow::bail!("rogue: expected a LIMIT refusal, got {other:?}"),
                }
            }
            let said = said.unwrap_or_default();
            return finish_failed(&mut conn, &*driver, lend.job, handles, said);
        }
        lie @ ("arena-carve-out-of-bounds" | "arena-carve-overlap" | "arena-carve-misaligned") => {
            let Some(slice) = lend.slice else {
                anyhow::bail!("rogue: {lie} needs an arena slice, and the Lend had none");
            };
            let carve = |index: u32, offset: u64| CarvedResult {
                index,
                offset,
                bytes: 1024,
                dtype: DType::U8,
                shape: vec![1024],
            };
            let carved = match lie {
                "arena-carve-out-of-bounds" => vec![carve(0, slice.bytes)],
                "arena-carve-overlap" => vec![carve(0, 0), carve(1, 512)],
                _ => vec![carve(0, 100)],
            };
            let mut handles = handles;
            handles.push(slice.handle);
            Message::Done(Done {
                job: lend.job,
                done_event: EventBlob([7; 64]),
                handles,
                carved,
            })
        }
        "arena-ack-before-done" => {
            conn.send(
                &Message::ResultRequest(ResultRequest {
                    job: lend.job,
                    results: vec![ResultSpec {
                        dtype: DType::U8,
                        shape: vec![4096],
                        byte_len: 4096,
                    }],
                }),
                &[],
                deadline(),
            )?;
            let grant = loop {
                match conn.recv(deadline())?.0 {
                    Message::AllocationGrant(g) => break g,
                    Message::Heartbeat { .. } | Message::ArenaChunk(_) => {}
                    other => anyhow::bail!("rogue: expected a grant, got {}", other.kind()),
                }
            };
            let mut handles = handles;
            for g in &grant.results {
                match g {
                    poolipc::advanced::contract::ResultGrant::Arena { handle, .. } => {
                        handles.push(*handle)
                    }
                    other => anyhow::bail!("rogue: expected an arena grant, got {other:?}"),
                }
            }
            Message::Ack(Ack {
                job: lend.job,
                handles,
            })
        }
        "garbage-frame" => {
            let mut raw = std::fs::File::from(conn.into_fd());
            raw.write_all(b"\xffGARBAGE-NOT-A-FRAME-AT-ALL-GARBAGE")?;
            std::thread::sleep(Duration::from_secs(60));
            return Ok(());
        }
        "exit-on-first-job" => std::process::exit(3),
        "silent" => {
            std::thread::sleep(Duration::from_secs(600));
            return Ok(());
        }
        other => anyhow::bail!("rogue: unknown mode {other:?}"),
    };
    conn.send(&bad, &[], deadline())?;
    // Stay alive: the parent must kill it.
    std::thread::sleep(Duration::from_secs(600));
    Ok(())
}

/// `canary-fail`: every job by the protocol, its results asked for and granted, DONE and ACK
/// in order, but nothing written: the canary battery finds wrong bytes. Exits at `Bye`.
fn canary_fail(
    mut conn: poolipc::advanced::transport::Connection,
    driver: &dyn Driver,
) -> anyhow::Result<()> {
    driver.use_device(0)?;
    let extra = std::env::var_os("POOLIPC_TEST_ROGUE_EXTRA").is_some();
    let long = || Instant::now() + Duration::from_secs(600);
    let mut events = poolipc_tests::chaos::DoneRing::new(driver);
    loop {
        let lend = match conn.recv(long())?.0 {
            Message::Lend(l) => l,
            Message::Bye => return Ok(()),
            _ => continue,
        };
        let mut handles: Vec<_> = lend.tensors.iter().map(|t| t.handle).collect();
        handles.extend(lend.slice.map(|s| s.handle));
        let mut results: Vec<ResultSpec> = lend
            .tensors
            .iter()
            .map(|t| ResultSpec {
                dtype: t.meta.layout.dtype,
                shape: t.meta.layout.shape.clone(),
                byte_len: t.meta.byte_len,
            })
            .collect();
        if extra {
            // One result more than the job has inputs.
            results.push(ResultSpec {
                dtype: DType::U8,
                shape: vec![4096],
                byte_len: 4096,
            });
        }
        if !results.is_empty() {
            conn.send(
                &Message::ResultRequest(ResultRequest {
                    job: lend.job,
                    results,
                }),
                &[],
                long(),
            )?;
            for g in recv_grant(&mut conn)?.results {
                match g {
                    poolipc::advanced::contract::ResultGrant::Granted { handle, .. }
                    | poolipc::advanced::contract::ResultGrant::Arena { handle, .. } => {
                        handles.push(handle)
                    }
                    poolipc::advanced::contract::ResultGrant::Refused { .. } => {}
                }
            }
        }
        let done_event = events.record()?;
        poolipc_tests::chaos::send_done_and_ack(&mut conn, lend.job, done_event, handles, long())?;
    }
}

/// The number in the variable `var`, or `default` where it is not set.
fn env_or(var: &str, default: u64) -> anyhow::Result<u64> {
    match std::env::var(var) {
        Ok(v) => v
            .parse()
            .map_err(|e| anyhow::anyhow!("{var}={v:?} is not a whole number: {e}")),
        Err(_) => Ok(default),
    }
}

/// `slow-frames`: each frame's header now, its payload a delay later, forever (until the
/// parent closes the connection).
fn slow_frames(conn: poolipc::advanced::transport::Connection) -> anyhow::Result<()> {
    let delay = std::env::var("POOLIPC_TEST_ROGUE_DELAY_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    std::thread::sleep(Duration::from_millis(200));
    let mut raw = std::fs::File::from(conn.into_fd());
    for seq in 0.. {
        let frame = poolipc::advanced::transport::codec::encode(
            &Message::Heartbeat { seq },
            poolipc::advanced::transport::FrameLimits::default(),
        )?;
        let (header, rest) = frame.split_at(poolipc::advanced::transport::codec::HEADER_LEN);
        if raw.write_all(header).is_err() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(delay));
        if raw.write_all(rest).is_err() {
            return Ok(());
        }
    }
    Ok(())
}

/// `fd-drip`: a valid frame one byte at a time, a descriptor on every byte.
fn fd_drip(conn: poolipc::advanced::transport::Connection) -> anyhow::Result<()> {
    use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
    use std::os::fd::AsRawFd as _;
    std::thread::sleep(Duration::from_millis(200));
    let sock = conn.into_fd();
    let null = std::fs::File::open("/dev/null")?;
    let frame = poolipc::advanced::transport::codec::encode(
        &Message::JobError {
            job: JobId(1),
            message: "x".repeat(1000),
        },
        poolipc::advanced::transport::FrameLimits::default(),
    )?;
    let fds = [null.as_raw_fd()];
    for byte in frame.chunks(1) {
        let iov = [std::io::IoSlice::new(byte)];
        let cmsg = [ControlMessage::ScmRights(&fds)];
        if sendmsg::<()>(sock.as_raw_fd(), &iov, &cmsg, MsgFlags::MSG_NOSIGNAL, None).is_err() {
            // The parent let go of us: done.
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_secs(600));
    Ok(())
}

/// `arena-snoop`: everything the arena chunks it was sent hold, read and overwritten through
/// its own mappings, reported as the job's error.
fn arena_snoop(
    mut conn: poolipc::advanced::transport::Connection,
    driver: Arc<dyn Driver>,
) -> anyhow::Result<()> {
    use anyhow::Context as _;
    use std::os::fd::AsFd as _;
    let deadline = || Instant::now() + Duration::from_secs(30);
    let patterns = std::env::var("POOLIPC_TEST_ROGUE_PATTERNS").unwrap_or_default();
    let patterns = patterns
        .split(',')
        .filter(|p| !p.is_empty())
        .map(|p| u32::from_str_radix(p.trim_start_matches("0x"), 16))
        .collect::<Result<Vec<u32>, _>>()?;
    driver.use_device(0)?;
    let mut mapping = poolipc::advanced::pool::ArenaMapping::new(Arc::clone(&driver), 0);
    let mut chunks = Vec::new();
    let lend = loop {
        match conn.recv(deadline())? {
            (Message::ArenaChunk(c), fds) => {
                let fd = fds
                    .into_iter()
                    .next()
                    .context("an ArenaChunk without its FD")?;
                let base = mapping.map_chunk(c.index, c.len, fd.as_fd())?;
                chunks.push((c.index, c.len, base));
            }
            (Message::Lend(l), _) => break l,
            (Message::Heartbeat { .. }, _) => {}
            (other, _) => anyhow::bail!("rogue: expected a Lend, got {}", other.kind()),
        }
    };
    let owned_stream = OwnedStream::new(driver.clone())?;
    let stream = owned_stream.handle();
    let mut ready = Vec::new();
    for t in &lend.tensors {
        if t.ready_event != EventBlob([0; 64]) && !ready.contains(&t.ready_event) {
            let event = driver.ipc_open_event_handle(&t.ready_event)?;
            driver.stream_wait_event(stream, event)?;
            ready.push(t.ready_event);
        }
    }
    let mut found = vec![0u64; patterns.len()];
    let mut overwrote = 0u64;
    for &(_, len, base) in &chunks {
        let mut bytes = vec![0u8; usize::try_from(len)?];
        driver.memcpy_dtoh_on(&mut bytes, base, stream)?;
        for word in bytes.chunks_exact(4) {
            let w = u32::from_le_bytes([word[0], word[1], word[2], word[3]]);
            for (n, p) in found.iter_mut().zip(&patterns) {
                *n += u64::from(w == *p);
            }
        }
        driver.memset_d8_async(base, 0xEE, len, stream)?;
        overwrote += len;
    }
    driver.stream_synchronize(stream)?;
    let listed: Vec<String> = chunks.iter().map(|(i, l, _)| format!("{i}:{l}")).collect();
    let counts: Vec<String> = patterns
        .iter()
        .zip(&found)
        .map(|(p, n)| format!("{p:#010x}={n}"))
        .collect();
    let said = format!(
        "arena-snoop: chunks {}; found {}; overwrote {overwrote}",
        listed.join(","),
        counts.join(",")
    );
    let handles = lend.tensors.iter().map(|t| t.handle).collect();
    let result = finish_failed_on(&mut conn, &*driver, lend.job, handles, said, stream);
    drop(mapping);
    result
}

/// The next `AllocationGrant`, skipping what a worker may be sent meanwhile.
fn recv_grant(
    conn: &mut poolipc::advanced::transport::Connection,
) -> anyhow::Result<poolipc::advanced::contract::AllocationGrant> {
    loop {
        match conn.recv(Instant::now() + Duration::from_secs(30))?.0 {
            Message::AllocationGrant(g) => return Ok(g),
            Message::Heartbeat { .. } | Message::ArenaChunk(_) => {}
            other => anyhow::bail!("rogue: expected a grant, got {}", other.kind()),
        }
    }
}

/// Fails `job` with `said` and finishes it properly (a DONE event of its own, then the
/// ACK), then stays until the parent's `Bye`.
fn finish_failed(
    conn: &mut poolipc::advanced::transport::Connection,
    driver: &dyn Driver,
    job: JobId,
    handles: Vec<poolipc::advanced::types::HandoffId>,
    said: String,
) -> anyhow::Result<()> {
    driver.use_device(0)?;
    finish_failed_on(
        conn,
        driver,
        job,
        handles,
        said,
        poolipc::StreamHandle::NULL,
    )
}

/// [`finish_failed`] with the DONE recorded on `stream` (after the work queued there).
fn finish_failed_on(
    conn: &mut poolipc::advanced::transport::Connection,
    driver: &dyn Driver,
    job: JobId,
    handles: Vec<poolipc::advanced::types::HandoffId>,
    said: String,
    stream: poolipc::StreamHandle,
) -> anyhow::Result<()> {
    let deadline = || Instant::now() + Duration::from_secs(30);
    conn.send(&Message::JobError { job, message: said }, &[], deadline())?;
    let event = OwnedEvent::new(driver, true)?.into_raw();
    driver.event_record(event, stream)?;
    let done_event = driver.ipc_get_event_handle(event)?;
    conn.send(
        &Message::Done(Done {
            job,
            done_event,
            handles: handles.clone(),
            carved: Vec::new(),
        }),
        &[],
        deadline(),
    )?;
    conn.send(&Message::Ack(Ack { job, handles }), &[], deadline())?;
    // Alive and well: leave when the parent says goodbye.
    loop {
        if let Message::Bye = conn.recv(Instant::now() + Duration::from_secs(600))?.0 {
            return Ok(());
        }
    }
}

/// `staging-slow`, with `late_ready` `staging-late-ready`, with `ask_result` too
/// `staging-late-result`: see the module docs.
fn staging_slow(
    mut conn: poolipc::advanced::transport::Connection,
    late_ready: bool,
    ask_result: bool,
) -> anyhow::Result<()> {
    let delay = Duration::from_millis(
        std::env::var("POOLIPC_TEST_ROGUE_DELAY_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(300),
    );
    let long = || Instant::now() + Duration::from_secs(600);
    let bytes = loop {
        match conn.recv(long())?.0 {
            Message::StagingBuffer(b) => break b.bytes,
            Message::Lend(l) if ask_result => conn.send(
                &Message::ResultRequest(ResultRequest {
                    job: l.job,
                    results: vec![ResultSpec {
                        dtype: DType::U8,
                        shape: vec![4096],
                        byte_len: 4096,
                    }],
                }),
                &[],
                Instant::now() + Duration::from_secs(30),
            )?,
            Message::Heartbeat { .. } | Message::ArenaChunk(_) | Message::Lend(_) => {}
            other => anyhow::bail!("rogue: expected a StagingBuffer, got {}", other.kind()),
        }
    };
    let (ready_delay, ack_delay) = if late_ready {
        (delay, Duration::ZERO)
    } else {
        (Duration::ZERO, delay)
    };
    std::thread::sleep(ready_delay);
    conn.send(
        &Message::StagingReady { bytes },
        &[],
        Instant::now() + Duration::from_secs(30),
    )?;
    loop {
        match conn.recv(long())?.0 {
            Message::Chunk(c) => {
                std::thread::sleep(ack_delay);
                conn.send(
                    &Message::Chunk(c),
                    &[],
                    Instant::now() + Duration::from_secs(30),
                )?;
            }
            Message::Bye => return Ok(()),
            _ => {}
        }
    }
}

/// `staging-gpu-hang`: see the module docs.
fn staging_gpu_hang(mut conn: poolipc::advanced::transport::Connection) -> anyhow::Result<()> {
    use anyhow::Context as _;
    use std::io::BufRead as _;
    let long = || Instant::now() + Duration::from_secs(600);
    let setup = loop {
        match conn.recv(long())?.0 {
            Message::StagingBuffer(b) => break b,
            Message::Heartbeat { .. } | Message::ArenaChunk(_) | Message::Lend(_) => {}
            other => anyhow::bail!("rogue: expected a StagingBuffer, got {}", other.kind()),
        }
    };
    let hex: String = setup.drained_event[0]
        .0
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let mut recorder = std::process::Command::new(std::env::current_exe()?)
        .env("POOLIPC_TEST_ROGUE", "staging-hang-recorder")
        .env("POOLIPC_TEST_ROGUE_EVENT", hex)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let mut line = String::new();
    std::io::BufReader::new(recorder.stdout.take().context("the recorder's stdout")?)
        .read_line(&mut line)?;
    anyhow::ensure!(line.trim() == "recorded", "the recorder said {line:?}");
    // The recorder's stdin stays open for as long as this process lives (see its docs).
    let _alive = recorder.stdin.take();
    conn.send(
        &Message::StagingReady { bytes: setup.bytes },
        &[],
        Instant::now() + Duration::from_secs(30),
    )?;
    loop {
        match conn.recv(long())?.0 {
            Message::Chunk(c) => conn.send(
                &Message::Chunk(c),
                &[],
                Instant::now() + Duration::from_secs(30),
            )?,
            Message::Bye => return Ok(()),
            _ => {}
        }
    }
}

/// `staging-gpu-hang`'s helper process (not a worker): opens the event whose blob
/// `POOLIPC_TEST_ROGUE_EVENT` holds (hex), records it behind a kernel that never ends, says
/// `recorded` on stdout, and exits 5 s after its stdin closed (the rogue died).
fn staging_hang_recorder(driver: &Arc<dyn Driver>) -> anyhow::Result<()> {
    use anyhow::Context as _;
    use std::io::Read as _;
    let hex = std::env::var("POOLIPC_TEST_ROGUE_EVENT")?;
    let mut blob = [0u8; 64];
    for (i, b) in blob.iter_mut().enumerate() {
        let digits = hex.get(2 * i..2 * i + 2).context("a short event blob")?;
        *b = u8::from_str_radix(digits, 16)?;
    }
    driver.use_device(0)?;
    let event =
        poolipc::advanced::driver::OwnedEvent::open_ipc(Arc::clone(driver), &EventBlob(blob))?;
    let owned_stream = OwnedStream::new(driver.clone())?;
    let stream = owned_stream.handle();
    driver.launch_hang_kernel(stream)?;
    driver.event_record(event.handle(), stream)?;
    let mut out = std::io::stdout();
    writeln!(out, "recorded")?;
    out.flush()?;
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    std::thread::sleep(Duration::from_secs(5));
    // Not a plain exit: the driver's teardown at exit waits for the hung kernel, so the
    // process would stay on the GPU, spinning, for every test after this one (on the H100,
    // 2026-12-05, two such recorders outlived the whole suite and slowed the demo after it
    // from 0.6 to 13.8 ms a round trip). A killed process's context goes at once
    // (`bench/probes/killed_kernel.py`).
    nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL)?;
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("poolipc-test-rogue: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `pool-thief`: imports the Hello's descriptor as a pool, and with it every tensor of the
/// first `Lend`; reports to `POOLIPC_TEST_REPORT`.
fn pool_thief(
    driver: &Arc<dyn Driver>,
    mut conn: poolipc::advanced::transport::Connection,
    pool_fd: &std::os::fd::OwnedFd,
) -> anyhow::Result<()> {
    use std::os::fd::AsFd as _;
    let report_path = std::env::var("POOLIPC_TEST_REPORT")?;
    let mut report = std::fs::File::create(&report_path)?;
    driver.use_device(0)?;
    let pool = match poolipc::advanced::driver::OwnedPool::import_fd(&**driver, pool_fd.as_fd()) {
        Ok(p) => {
            writeln!(report, "pool: imported")?;
            p
        }
        Err(e) => {
            writeln!(report, "pool: refused: {e}")?;
            // Stay until the parent says goodbye, as a worker does (an exit now could race
            // the parent's spawn).
            while let Ok((msg, _)) = conn.recv(Instant::now() + Duration::from_secs(60)) {
                if matches!(msg, Message::Bye) {
                    break;
                }
            }
            return Ok(());
        }
    };
    let lend = loop {
        match conn.recv(Instant::now() + Duration::from_secs(30))?.0 {
            Message::Lend(l) => break l,
            _ => continue,
        }
    };
    let mut imported = 0;
    for t in &lend.tensors {
        if let Ok(p) = driver.mem_pool_import_pointer(pool.handle(), &t.export) {
            imported += 1;
            // SAFETY: `p` was imported just now through `pool` and is used by nothing else.
            let _ = unsafe { driver.mem_pool_free_import(p, poolipc::StreamHandle::NULL) };
        }
    }
    writeln!(report, "pointers: {imported} imported")?;
    Ok(())
}
