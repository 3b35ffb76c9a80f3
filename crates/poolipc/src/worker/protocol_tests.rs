//! The facade's worker (the tests' echo worker over [`poolipc::Worker`]) against a scripted
//! parent on SimDriver: what it sends, in what order, is what the contract's worker machine
//! emitted.
//! Each test re-executes this binary as the worker (`--exact <its own path>`), which serves
//! jobs with the echo worker until Bye and appends `<job> <read-only flags>` per job to the
//! file named by `REPORT`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed unwrap is a failed test

use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use poolipc::advanced::driver::sim::{SimConfig, SimDriver};
use poolipc::advanced::driver::{
    DevicePtr, Driver, EventHandle, OwnedEvent, OwnedStream, StreamHandle,
};
use poolipc::advanced::pool::SharedPool;
use poolipc::advanced::transport::Layout;
use poolipc::advanced::transport::{
    AllocId, AllocationGrant, Capabilities, Connection, DType, ErrorCode, EventBlob, ExportBlob,
    HandoffId, HandshakeConfig, JobId, Lend, LentTensor, Message, ResultGrant, Rung, TensorMeta,
    parent_handshake, spawn_worker,
};

// The parent's side of host staging is this crate's own channel; the rest of the script and
// the worker use the crate as a dependency would (`poolipc::`, this crate built with its
// `testing` feature), as does the echo worker.
use crate::staging::{StagingChannel, StagingConfig};

// The echo worker of the multi-process tests (crate `poolipc-tests`), one source for both.
#[path = "../../../../tests/src/echo.rs"]
#[allow(dead_code, unreachable_pub)] // the tests' module: this binary uses part of it
mod echo;

const ROLE: &str = "POOLIPC_WORKER_PROTOCOL_TEST_ROLE";
const REPORT: &str = "POOLIPC_WORKER_PROTOCOL_TEST_REPORT";
/// Set: the worker waits with `next_job_within` (60 s at a time) instead of `next_job`.
const WITHIN: &str = "POOLIPC_WORKER_PROTOCOL_TEST_WITHIN";

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(30)
}

fn bytes_meta(bytes: u64) -> TensorMeta {
    TensorMeta {
        layout: Layout {
            dtype: DType::U8,
            shape: vec![bytes],
            strides: vec![1],
        },
        byte_offset: 0,
        byte_len: bytes,
    }
}

/// The worker side of every test.
fn serve() -> ! {
    let sim = SimDriver::from_env()
        .unwrap()
        .expect("a machine to attach to");
    let mut worker = poolipc::Worker::from_env(Arc::new(sim), 0).unwrap();
    let report = PathBuf::from(std::env::var_os(REPORT).unwrap());
    let mut lines = String::new();
    let within = std::env::var_os(WITHIN).is_some();
    let mut release_next = false;
    loop {
        if std::mem::take(&mut release_next) {
            // Before the parent's `ReleaseMappings`, which the next wait answers.
            let held = worker.vmm_share_stats();
            lines.push_str(&format!(
                "held {} (mapped {}, resolved {})\n",
                held.held, held.mapped, held.resolved
            ));
        }
        let next = if within {
            match worker.next_job_within(Duration::from_secs(60)) {
                Ok(poolipc::NextJob::Job(job)) => Ok(Some(job)),
                Ok(poolipc::NextJob::Idle) => continue,
                Ok(poolipc::NextJob::Gone) => Ok(None),
                Err(e) => Err(e),
            }
        } else {
            worker.next_job()
        };
        let mut job = match next {
            Ok(Some(job)) => job,
            Ok(None) => break,
            // A job whose views cannot be built (a malformed Lend) was finished already:
            // report it and take the next, as user code may.
            Err(e) => {
                eprintln!("worker: refused: {e}");
                lines.push_str(&format!("refused: {e}\n"));
                continue;
            }
        };
        let flags: Vec<bool> = job.inputs().iter().map(|i| i.read_only).collect();
        lines.push_str(&format!("{} {flags:?}\n", job.id().0));
        if job.inputs().first().is_some_and(|i| i.byte_len == 13) {
            // The worker's code returns early without finishing the job.
            drop(job);
            continue;
        }
        // An input of 8192 bytes: once the job is finished, the parent (this script) asks for
        // the cached VMM mappings to be dropped; what they were goes in the report first.
        let release = job.inputs().first().is_some_and(|i| i.byte_len == 8192);
        match echo::answer(&mut job) {
            Ok(()) => job.finish().unwrap(),
            Err(e) => job.fail(&e.to_string()).unwrap(),
        }
        release_next = release;
    }
    std::fs::write(report, lines).unwrap();
    std::process::exit(0);
}

/// The parent side: a pool, a stream, a READY event, a connection to the worker.
struct Script {
    sim: Arc<SimDriver>,
    driver: Arc<dyn Driver>,
    pool: SharedPool<dyn Driver>,
    stream: StreamHandle,
    ready: EventHandle,
    ready_blob: EventBlob,
    conn: Connection,
    child: Child,
    report: PathBuf,
}

impl Script {
    /// Starts the worker running `test` (or, in the worker, serves and exits).
    fn start(test: &str) -> Script {
        Script::start_with_env(test, &[])
    }

    /// [`Script::start`], the worker's environment with `env` added.
    fn start_with_env(test: &str, env: &[(&str, &str)]) -> Script {
        if std::env::var_os(ROLE).is_some() {
            serve();
        }
        let sim = Arc::new(
            SimDriver::new(SimConfig {
                memory_per_device: 1 << 30,
                ..SimConfig::default()
            })
            .unwrap(),
        );
        let driver: Arc<dyn Driver> = sim.clone();
        driver.use_device(0).unwrap();
        let pool = SharedPool::install(Arc::clone(&driver), 0).unwrap();
        let stream = OwnedStream::new(driver.clone()).unwrap().into_raw();
        let ready = OwnedEvent::new(driver.clone(), true).unwrap().into_raw();
        let ready_blob = driver.ipc_get_event_handle(ready).unwrap();
        let report = std::env::temp_dir().join(format!("{test}-{}.report", std::process::id()));
        // The harness names a unit test by its path below the crate.
        let path = format!("{}::{test}", module_path!().trim_start_matches("poolipc::"));
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args([path.as_str(), "--exact", "--nocapture"]);
        let (k, v) = sim.child_env();
        cmd.env(k, v).env(ROLE, "worker").env(REPORT, &report);
        cmd.envs(env.iter().copied());
        let (child, mut conn) = spawn_worker(cmd).unwrap();
        let caps =
            Capabilities::POOL_POINTER | Capabilities::IPC_EVENTS | Capabilities::HOST_STAGING;
        let config = HandshakeConfig {
            identity: poolipc::advanced::identity(&*driver, 0, caps).unwrap(),
            required: Capabilities::NONE,
        };
        parent_handshake(
            &mut conn,
            &config,
            std::os::fd::AsFd::as_fd(&*pool.fd()),
            deadline(),
        )
        .unwrap();
        Script {
            sim,
            driver,
            pool,
            stream,
            ready,
            ready_blob,
            conn,
            child,
            report,
        }
    }

    /// A pool allocation of `bytes` filled with `pattern`, READY recorded after.
    fn pooled(&self, bytes: u64, pattern: u32) -> (DevicePtr, ExportBlob) {
        let ptr = self.pool.alloc(bytes, self.stream).unwrap();
        echo::fill_pattern(&*self.driver, ptr, bytes, pattern, self.stream).unwrap();
        self.driver.event_record(self.ready, self.stream).unwrap();
        (ptr, self.pool.export(ptr).unwrap())
    }

    fn pointer(&self, handle: u64, alloc: u64, export: ExportBlob, bytes: u64) -> LentTensor {
        LentTensor {
            handle: HandoffId(handle),
            alloc: AllocId(alloc),
            rung: Rung::PoolPointer,
            pool: 0,
            export,
            ready_event: self.ready_blob,
            meta: bytes_meta(bytes),
            read_only: false,
            arena: None,
        }
    }

    fn send(&mut self, message: Message) {
        self.conn.send(&message, &[], deadline()).unwrap();
    }

    fn recv(&mut self) -> Message {
        loop {
            match self.conn.recv(deadline()).unwrap().0 {
                Message::Heartbeat { .. } => {}
                m => return m,
            }
        }
    }

    /// Waits on the DONE event of `message` (a Done) on the parent's stream, then for the
    /// stream.
    fn wait_done(&self, message: &Message) {
        let Message::Done(done) = message else {
            panic!("expected a Done, got {message:?}");
        };
        let event = poolipc::advanced::driver::OwnedEvent::open_ipc(
            Arc::clone(&self.driver),
            &done.done_event,
        )
        .unwrap();
        self.driver
            .stream_wait_event(self.stream, event.handle())
            .unwrap();
        self.driver.stream_synchronize(self.stream).unwrap();
        event.close().unwrap();
    }

    /// Bye; the worker exits; its report, and no violation recorded.
    fn end(mut self) -> String {
        self.send(Message::Bye);
        assert!(self.child.wait().unwrap().success(), "the worker failed");
        let v = self.sim.violations();
        assert!(v.is_empty(), "violations recorded: {v:#?}");
        let report = std::fs::read_to_string(&self.report).unwrap();
        let _ = std::fs::remove_file(&self.report);
        report
    }
}

fn handles(message: &Message) -> Vec<HandoffId> {
    match message {
        Message::Done(d) => d.handles.clone(),
        Message::Ack(a) => a.handles.clone(),
        other => panic!("expected a Done or an Ack, got {other:?}"),
    }
}

#[test]
fn a_lend_arriving_while_a_job_waits_for_its_grant_is_served_after_that_job_acks() {
    let mut s = Script::start(
        "a_lend_arriving_while_a_job_waits_for_its_grant_is_served_after_that_job_acks",
    );
    let (_, input) = s.pooled(4096, 0x1122_3344);
    let lend = |s: &Script, job: u64, handle: u64| {
        Message::Lend(Lend {
            job: JobId(job),
            tensors: vec![s.pointer(handle, 1, input, 4096)],
            slice: None,
        })
    };
    s.send(lend(&s, 1, 1));
    let Message::ResultRequest(request) = s.recv() else {
        panic!("no result request")
    };
    assert_eq!((request.job, request.results[0].byte_len), (JobId(1), 4096));
    // Job 2 lends the same allocation before job 1's grant.
    s.send(lend(&s, 2, 2));
    let (result, export) = s.pooled(4096, 0);
    s.send(Message::AllocationGrant(AllocationGrant {
        job: JobId(1),
        results: vec![ResultGrant::Granted {
            handle: HandoffId(3),
            alloc: AllocId(2),
            rung: Rung::PoolPointer,
            pool: 0,
            export,
            ready_event: s.ready_blob,
        }],
    }));
    let done = s.recv();
    assert_eq!(handles(&done), [HandoffId(1), HandoffId(3)]);
    assert_eq!(
        handles(&s.recv()),
        [HandoffId(1), HandoffId(3)],
        "job 1's Ack"
    );
    s.wait_done(&done);
    echo::verify_echo(&*s.driver, result, 4096, 0, 0x1122_3344, 0).unwrap();
    let Message::ResultRequest(request) = s.recv() else {
        panic!("job 2 was not served")
    };
    assert_eq!(request.job, JobId(2));
    s.send(Message::AllocationGrant(AllocationGrant {
        job: JobId(2),
        results: vec![ResultGrant::Refused {
            code: ErrorCode::CANCELLED,
            message: "not now".into(),
        }],
    }));
    let Message::JobError { job, message } = s.recv() else {
        panic!("no JobError")
    };
    assert_eq!(job, JobId(2));
    assert!(message.contains("not now"), "{message}");
    assert_eq!(handles(&s.recv()), [HandoffId(2)], "job 2's Done");
    assert_eq!(handles(&s.recv()), [HandoffId(2)], "job 2's Ack");
    assert_eq!(s.end(), "1 [false]\n2 [false]\n");
}

#[test]
fn a_read_only_staged_input_stays_and_a_staged_result_follows_the_done_that_names_it() {
    let mut s = Script::start(
        "a_read_only_staged_input_stays_and_a_staged_result_follows_the_done_that_names_it",
    );
    let config = StagingConfig {
        chunk: 4096,
        ..StagingConfig::default()
    };
    let mut ch = StagingChannel::setup_parent(Arc::clone(&s.driver), &mut s.conn, config).unwrap();
    assert!(ch.take_backlog().is_empty());
    let bytes = 10_000;
    let src = s.driver.mem_alloc_async(bytes, s.stream).unwrap();
    echo::fill_pattern(&*s.driver, src, bytes, 0x5566_7788, s.stream).unwrap();
    let (_, pointer) = s.pooled(64, 0x0102_0304);
    let lent = vec![
        LentTensor {
            handle: HandoffId(1),
            alloc: AllocId(1),
            rung: Rung::HostStaging,
            pool: 0,
            export: ExportBlob([0; 64]),
            ready_event: EventBlob([0; 64]),
            meta: bytes_meta(bytes),
            // Read-only: nothing comes back (a writable one would follow the DONE first).
            read_only: true,
            arena: None,
        },
        s.pointer(2, 2, pointer, 64),
    ];
    s.send(Message::Lend(Lend {
        job: JobId(7),
        tensors: lent,
        slice: None,
    }));
    ch.send_tensor(&mut s.conn, JobId(7), HandoffId(1), src, bytes, s.stream)
        .unwrap();
    let Message::ResultRequest(request) = s.recv() else {
        panic!("no result request")
    };
    assert_eq!(request.results.len(), 2);
    let dst = s.driver.mem_alloc_async(bytes, s.stream).unwrap();
    let (_, export) = s.pooled(64, 0);
    s.send(Message::AllocationGrant(AllocationGrant {
        job: JobId(7),
        results: vec![
            ResultGrant::Granted {
                handle: HandoffId(3),
                alloc: AllocId(3),
                rung: Rung::HostStaging,
                pool: 0,
                export: ExportBlob([0; 64]),
                ready_event: EventBlob([0; 64]),
            },
            ResultGrant::Granted {
                handle: HandoffId(4),
                alloc: AllocId(4),
                rung: Rung::PoolPointer,
                pool: 0,
                export,
                ready_event: s.ready_blob,
            },
        ],
    }));
    let done = s.recv();
    assert_eq!(
        handles(&done),
        [HandoffId(1), HandoffId(2), HandoffId(3), HandoffId(4)]
    );
    ch.recv_tensor(&mut s.conn, JobId(7), HandoffId(3), dst, bytes, s.stream)
        .unwrap();
    assert!(ch.take_backlog().is_empty());
    assert_eq!(
        handles(&s.recv()).len(),
        4,
        "the Ack after the staged bytes"
    );
    s.wait_done(&done);
    echo::verify_echo(&*s.driver, dst, bytes, 0, 0x5566_7788, 0).unwrap();
    drop(ch);
    assert_eq!(s.end(), "7 [true, false]\n");
}

#[test]
fn an_arena_grant_outside_its_chunk_or_naming_an_unmapped_one_fails_only_that_job() {
    use std::os::fd::AsFd as _;
    let mut s = Script::start(
        "an_arena_grant_outside_its_chunk_or_naming_an_unmapped_one_fails_only_that_job",
    );
    let arena = poolipc::advanced::pool::Arena::new(Arc::clone(&s.driver), 0, 1).unwrap();
    let chunk = arena.chunks().next().unwrap();
    let fd = arena.export_fd(0).unwrap();
    s.conn
        .send(
            &Message::ArenaChunk(poolipc::advanced::transport::ArenaChunk {
                index: 0,
                len: chunk.len,
            }),
            &[fd.as_fd()],
            deadline(),
        )
        .unwrap();
    let (_, input) = s.pooled(4096, 0x0A0B_0C0D);
    let bad = [
        // Past the chunk's end.
        (chunk.len - 512, 0, "does not lie inside"),
        // A chunk never announced.
        (0, 7, "chunk 7 is not mapped"),
    ];
    let mut job = 0;
    let mut handle = 0;
    for (offset, index, why) in bad {
        job += 1;
        handle += 2;
        s.send(Message::Lend(Lend {
            job: JobId(job),
            tensors: vec![s.pointer(handle - 1, 1, input, 4096)],
            slice: None,
        }));
        let Message::ResultRequest(_) = s.recv() else {
            panic!("no result request")
        };
        s.send(Message::AllocationGrant(AllocationGrant {
            job: JobId(job),
            results: vec![ResultGrant::Arena {
                handle: HandoffId(handle),
                alloc: AllocId(100 + job),
                chunk: index,
                offset,
                bytes: 4096,
            }],
        }));
        let Message::JobError { message, .. } = s.recv() else {
            panic!("no JobError for a malformed arena grant")
        };
        assert!(message.contains(why), "{message}");
        let done = s.recv();
        assert_eq!(handles(&done).len(), 2);
        assert_eq!(handles(&s.recv()).len(), 2, "the Ack");
        s.wait_done(&done);
    }
    // The same worker then writes a well-formed arena result where it was told.
    let block = arena.alloc(4096).unwrap();
    s.send(Message::Lend(Lend {
        job: JobId(3),
        tensors: vec![s.pointer(5, 1, input, 4096)],
        slice: None,
    }));
    let Message::ResultRequest(_) = s.recv() else {
        panic!("no result request")
    };
    s.send(Message::AllocationGrant(AllocationGrant {
        job: JobId(3),
        results: vec![ResultGrant::Arena {
            handle: HandoffId(6),
            alloc: AllocId(200),
            chunk: block.chunk,
            offset: block.offset,
            bytes: block.len,
        }],
    }));
    let done = s.recv();
    assert_eq!(handles(&done), [HandoffId(5), HandoffId(6)]);
    assert_eq!(handles(&s.recv()).len(), 2, "the Ack");
    s.wait_done(&done);
    echo::verify_echo(&*s.driver, block.ptr, 4096, 0, 0x0A0B_0C0D, 0).unwrap();
    assert_eq!(s.end(), "1 [false]\n2 [false]\n3 [false]\n");
    drop(arena);
}

#[test]
fn an_arena_copy_outside_its_chunk_fails_only_that_job_and_a_good_one_is_read_through_the_mapping()
{
    use std::os::fd::AsFd as _;
    let mut s = Script::start(
        "an_arena_copy_outside_its_chunk_fails_only_that_job_and_a_good_one_is_read_through_the_mapping",
    );
    let arena = poolipc::advanced::pool::Arena::new(Arc::clone(&s.driver), 0, 1).unwrap();
    let chunk = arena.chunks().next().unwrap();
    let fd = arena.export_fd(0).unwrap();
    s.conn
        .send(
            &Message::ArenaChunk(poolipc::advanced::transport::ArenaChunk {
                index: 0,
                len: chunk.len,
            }),
            &[fd.as_fd()],
            deadline(),
        )
        .unwrap();
    let copy = |handle: u64, chunk: u32, offset: u64, ready: EventBlob| LentTensor {
        handle: HandoffId(handle),
        alloc: AllocId(handle),
        rung: Rung::ArenaCopy,
        pool: 0,
        export: ExportBlob([0; 64]),
        ready_event: ready,
        meta: bytes_meta(4096),
        read_only: false,
        arena: Some(poolipc::advanced::transport::ArenaLocation { chunk, offset }),
    };
    // Past the chunk's end, then a chunk never announced: the job's view cannot be built;
    // it is reported failed (JobError naming why), finished (Done, Ack), and the worker
    // goes on.
    for (job, (c, offset)) in [(0, chunk.len - 512), (7, 0)].into_iter().enumerate() {
        let job = job as u64 + 1;
        s.send(Message::Lend(Lend {
            job: JobId(job),
            tensors: vec![copy(job, c, offset, s.ready_blob)],
            slice: None,
        }));
        let Message::JobError {
            job: failed,
            message,
        } = s.recv()
        else {
            panic!("job {job} was not reported failed")
        };
        assert_eq!(failed, JobId(job));
        assert!(message.contains("could not be viewed"), "{message}");
        let done = s.recv();
        assert_eq!(handles(&done), [HandoffId(job)]);
        assert_eq!(handles(&s.recv()), [HandoffId(job)], "the Ack");
        s.wait_done(&done);
    }
    // A well-formed one: the parent copies a pattern into a block, records READY, lends it.
    let (src, _) = s.pooled(4096, 0x0A0B_0C0D);
    let block = arena.alloc(4096).unwrap();
    s.driver
        .memcpy_dtod_async(block.ptr, src, 4096, s.stream)
        .unwrap();
    s.driver.event_record(s.ready, s.stream).unwrap();
    s.send(Message::Lend(Lend {
        job: JobId(3),
        tensors: vec![copy(3, block.chunk, block.offset, s.ready_blob)],
        slice: None,
    }));
    let Message::ResultRequest(_) = s.recv() else {
        panic!("no result request")
    };
    let out = arena.alloc(4096).unwrap();
    s.send(Message::AllocationGrant(AllocationGrant {
        job: JobId(3),
        results: vec![ResultGrant::Arena {
            handle: HandoffId(4),
            alloc: AllocId(200),
            chunk: out.chunk,
            offset: out.offset,
            bytes: out.len,
        }],
    }));
    let done = s.recv();
    assert_eq!(handles(&done), [HandoffId(3), HandoffId(4)]);
    assert_eq!(handles(&s.recv()).len(), 2, "the Ack");
    s.wait_done(&done);
    echo::verify_echo(&*s.driver, out.ptr, 4096, 0, 0x0A0B_0C0D, 0).unwrap();
    let report = s.end();
    let lines: Vec<&str> = report.lines().collect();
    assert_eq!(lines.len(), 3, "{report}");
    assert!(
        lines[0].starts_with("refused: ") && lines[0].contains("does not lie inside"),
        "{report}"
    );
    assert!(
        lines[1].starts_with("refused: ") && lines[1].contains("chunk 7 is not mapped"),
        "{report}"
    );
    // Lent writable (the copy comes back to the caller's tensor), so the view is writable.
    assert_eq!(
        lines[2], "3 [false]",
        "an arena copy lent writable: {report}"
    );
    drop(arena);
}

#[test]
fn a_job_dropped_unfinished_is_reported_failed_then_finished_and_the_next_job_is_served() {
    let mut s = Script::start(
        "a_job_dropped_unfinished_is_reported_failed_then_finished_and_the_next_job_is_served",
    );
    let (_, odd) = s.pooled(13, 0x0D0D_0D0D);
    s.send(Message::Lend(Lend {
        job: JobId(1),
        tensors: vec![s.pointer(1, 1, odd, 13)],
        slice: None,
    }));
    // Not a Done that looks like success: the parent hears why first.
    let Message::JobError { job, message } = s.recv() else {
        panic!("a dropped job was not reported failed")
    };
    assert_eq!(job, JobId(1));
    assert!(message.contains("without finishing"), "{message}");
    let done = s.recv();
    assert_eq!(handles(&done), [HandoffId(1)], "job 1's Done");
    assert_eq!(handles(&s.recv()), [HandoffId(1)], "job 1's Ack");
    s.wait_done(&done);
    // The worker goes on.
    let (_, input) = s.pooled(4096, 0x5566_7788);
    s.send(Message::Lend(Lend {
        job: JobId(2),
        tensors: vec![s.pointer(2, 2, input, 4096)],
        slice: None,
    }));
    let Message::ResultRequest(request) = s.recv() else {
        panic!("job 2 was not served")
    };
    assert_eq!(request.job, JobId(2));
    s.send(Message::AllocationGrant(AllocationGrant {
        job: JobId(2),
        results: vec![ResultGrant::Refused {
            code: ErrorCode::CANCELLED,
            message: "not now".into(),
        }],
    }));
    let Message::JobError { .. } = s.recv() else {
        panic!("no JobError for job 2")
    };
    assert_eq!(handles(&s.recv()), [HandoffId(2)], "job 2's Done");
    assert_eq!(handles(&s.recv()), [HandoffId(2)], "job 2's Ack");
    assert_eq!(s.end(), "1 [false]\n2 [false]\n");
}

#[test]
fn a_spinning_worker_serves_lends_inside_and_after_its_window_and_writes_done_with_its_ack() {
    // 20 ms of spin: the first lend comes inside it, the second after a 100 ms pause (the
    // worker asleep in its read by then).
    let mut s = Script::start_with_env(
        "a_spinning_worker_serves_lends_inside_and_after_its_window_and_writes_done_with_its_ack",
        &[("POOLIPC_WORKER_SPIN_US", "20000")],
    );
    let (_, input) = s.pooled(4096, 0x5566_7788);
    for (job, pause) in [(1u64, 0u64), (2, 100)] {
        std::thread::sleep(Duration::from_millis(pause));
        s.send(Message::Lend(Lend {
            job: JobId(job),
            tensors: vec![s.pointer(10 * job, job, input, 4096)],
            slice: None,
        }));
        let Message::ResultRequest(request) = s.recv() else {
            panic!("job {job}: no result request")
        };
        let (result, export) = s.pooled(4096, 0);
        s.send(Message::AllocationGrant(AllocationGrant {
            job: JobId(job),
            results: vec![ResultGrant::Granted {
                handle: HandoffId(10 * job + 1),
                alloc: AllocId(100 + job),
                rung: Rung::PoolPointer,
                pool: 0,
                export,
                ready_event: s.ready_blob,
            }],
        }));
        assert_eq!(request.job, JobId(job));
        let done = s.recv();
        assert_eq!(
            handles(&done),
            [HandoffId(10 * job), HandoffId(10 * job + 1)]
        );
        // The ACK was written with DONE: it came in the same read.
        assert!(
            s.conn.frame_buffered(),
            "job {job}: the Ack was not read with the Done"
        );
        let Message::Ack(ack) = s.recv() else {
            panic!("job {job}: no Ack after the Done")
        };
        assert_eq!(ack.job, JobId(job));
        s.wait_done(&done);
        echo::verify_echo(&*s.driver, result, 4096, 0, 0x5566_7788, 0).unwrap();
    }
    assert_eq!(s.end(), "1 [false]\n2 [false]\n");
}

#[test]
fn a_worker_waiting_within_a_deadline_takes_a_lend_that_came_in_the_same_read_as_the_last() {
    // Two lends in one write: the worker reads both at once, serves the first (its code drops
    // it: no round trip), then must find the second among the bytes it read already, not
    // wait on the socket for it (nothing more will come: the parent waits for the answer).
    let mut s = Script::start_with_env(
        "a_worker_waiting_within_a_deadline_takes_a_lend_that_came_in_the_same_read_as_the_last",
        &[(WITHIN, "1")],
    );
    let (_, first) = s.pooled(13, 0x0D0D_0D0D);
    let (_, second) = s.pooled(13, 0x0E0E_0E0E);
    let lends: Vec<Message> = [(1u64, first), (2, second)]
        .into_iter()
        .map(|(job, export)| {
            Message::Lend(Lend {
                job: JobId(job),
                tensors: vec![s.pointer(job, job, export, 13)],
                slice: None,
            })
        })
        .collect();
    s.conn
        .send_many(&lends.iter().collect::<Vec<_>>(), deadline())
        .unwrap();
    for job in [1u64, 2] {
        let Message::JobError { job: failed, .. } = s.recv() else {
            panic!("job {job} was not reported failed")
        };
        assert_eq!(failed, JobId(job));
        let done = s.recv();
        assert_eq!(handles(&done), [HandoffId(job)], "job {job}'s Done");
        assert_eq!(handles(&s.recv()), [HandoffId(job)], "job {job}'s Ack");
        s.wait_done(&done);
    }
    assert_eq!(s.end(), "1 [false]\n2 [false]\n");
}

#[test]
fn a_vmm_allocation_shared_once_serves_jobs_until_released_and_bad_names_fail_only_their_job() {
    use std::os::fd::AsFd as _;
    let mut s = Script::start(
        "a_vmm_allocation_shared_once_serves_jobs_until_released_and_bad_names_fail_only_their_job",
    );
    // Results go to the arena: one chunk, announced.
    let arena = poolipc::advanced::pool::Arena::new(Arc::clone(&s.driver), 0, 1).unwrap();
    let chunk = arena.chunks().next().unwrap();
    let fd = arena.export_fd(0).unwrap();
    s.conn
        .send(
            &Message::ArenaChunk(poolipc::advanced::transport::ArenaChunk {
                index: 0,
                len: chunk.len,
            }),
            &[fd.as_fd()],
            deadline(),
        )
        .unwrap();
    // The caller's VMM allocation (POSIX FD), filled, READY after; shared once, as the
    // parent does: retained from an interior address, exported, released.
    let d = Arc::clone(&s.driver);
    let g = d
        .vmm_granularity(0, poolipc::advanced::driver::Granularity::Minimum)
        .unwrap();
    // Unmapped (and its range freed) before the handle is released, at the end.
    let h = poolipc::advanced::driver::VmmAllocation::create(Arc::clone(&d), 0, g).unwrap();
    let range = poolipc::advanced::driver::VmmReservation::reserve(Arc::clone(&d), g, 0).unwrap();
    let mapping = poolipc::advanced::driver::VmmMapping::map(range, h.handle()).unwrap();
    let va = mapping.ptr();
    mapping
        .set_access(0, poolipc::advanced::driver::Access::ReadWrite)
        .unwrap();
    echo::fill_pattern(&*d, va, g, 0x5A5A_A5A5, s.stream).unwrap();
    d.event_record(s.ready, s.stream).unwrap();
    let retained =
        poolipc::advanced::driver::VmmAllocation::retain(Arc::clone(&d), va.offset(4096)).unwrap();
    let share_fd = d.vmm_export_fd(retained.handle()).unwrap();
    retained.close().unwrap();
    s.conn
        .send(
            &Message::VmmShare(poolipc::advanced::transport::VmmShare {
                alloc: AllocId(50),
                base: va.0,
                len: g,
            }),
            &[share_fd.as_fd()],
            deadline(),
        )
        .unwrap();
    drop(share_fd);
    let by_handle = |handle: u64, alloc: u64, offset: u64, bytes: u64, ready: EventBlob| {
        let mut meta = bytes_meta(bytes);
        meta.byte_offset = offset;
        LentTensor {
            handle: HandoffId(handle),
            alloc: AllocId(alloc),
            rung: Rung::VmmHandle,
            pool: 0,
            export: ExportBlob([0; 64]),
            ready_event: ready,
            meta,
            read_only: true,
            arena: None,
        }
    };
    // A served job: the echo reads the input through the mapping and writes its result.
    let serve = |s: &mut Script, job: u64, tensor: LentTensor, bytes: u64| {
        s.send(Message::Lend(Lend {
            job: JobId(job),
            tensors: vec![tensor],
            slice: None,
        }));
        let Message::ResultRequest(_) = s.recv() else {
            panic!("job {job}: no result request")
        };
        let out = arena.alloc(bytes).unwrap();
        s.send(Message::AllocationGrant(AllocationGrant {
            job: JobId(job),
            results: vec![ResultGrant::Arena {
                handle: HandoffId(2 * job),
                alloc: AllocId(1000 + job),
                chunk: out.chunk,
                offset: out.offset,
                bytes: out.len,
            }],
        }));
        let done = s.recv();
        assert_eq!(handles(&done).len(), 2, "job {job}");
        assert_eq!(handles(&s.recv()).len(), 2, "job {job}: the Ack");
        s.wait_done(&done);
        echo::verify_echo(&*s.driver, out.ptr, bytes, 0, 0x5A5A_A5A5, 0).unwrap();
    };
    // A refused job: its view cannot be built; reported, finished, and the worker goes on.
    let refuse = |s: &mut Script, job: u64, tensor: LentTensor| {
        s.send(Message::Lend(Lend {
            job: JobId(job),
            tensors: vec![tensor],
            slice: None,
        }));
        let Message::JobError { job: failed, .. } = s.recv() else {
            panic!("job {job} was not reported failed")
        };
        assert_eq!(failed, JobId(job));
        let done = s.recv();
        assert_eq!(handles(&done).len(), 1);
        assert_eq!(handles(&s.recv()).len(), 1, "the Ack");
        s.wait_done(&done);
    };
    let ready = s.ready_blob;
    serve(&mut s, 1, by_handle(1, 50, 0, 4096, ready), 4096);
    // The same allocation again, no share: the worker's mapping serves it.
    serve(&mut s, 2, by_handle(3, 50, 4096, 4096, ready), 4096);
    refuse(&mut s, 3, by_handle(5, 50, g - 512, 4096, ready));
    refuse(&mut s, 4, by_handle(7, 51, 0, 4096, ready));
    // 8192 bytes: the parent asks the worker to drop its mappings after this job.
    serve(&mut s, 5, by_handle(9, 50, 0, 8192, ready), 8192);
    s.send(Message::ReleaseMappings);
    let Message::MappingsReleased { dropped } = s.recv() else {
        panic!("no MappingsReleased")
    };
    assert_eq!(dropped, 1, "the one mapping");
    // Dropped: named again without a new share, it is unknown.
    refuse(&mut s, 6, by_handle(11, 50, 0, 4096, ready));
    let report = s.end();
    let lines: Vec<&str> = report.lines().collect();
    assert_eq!(lines.len(), 7, "{report}");
    assert_eq!(lines[0], "1 [true]", "{report}");
    assert_eq!(lines[1], "2 [true]", "{report}");
    assert!(
        lines[2].starts_with("refused: ") && lines[2].contains("lies outside VMM allocation"),
        "{report}"
    );
    assert!(
        lines[3].starts_with("refused: ") && lines[3].contains("never shared"),
        "{report}"
    );
    assert_eq!(lines[4], "5 [true]", "{report}");
    assert_eq!(
        lines[5], "held 1 (mapped 1, resolved 3)",
        "one share, one mapping, three views through it: {report}"
    );
    assert!(
        lines[6].starts_with("refused: ") && lines[6].contains("never shared"),
        "{report}"
    );
    drop(arena);
    mapping.close().unwrap();
    h.close().unwrap();
}

#[test]
fn a_worker_takes_a_pool_generation_at_any_free_index_and_destroys_a_retired_ones_import() {
    use std::os::fd::AsFd as _;
    let mut s = Script::start(
        "a_worker_takes_a_pool_generation_at_any_free_index_and_destroys_a_retired_ones_import",
    );
    let free = |s: &Script| s.driver.mem_get_info().unwrap().0;
    let before = free(&s);
    // Exported and freed: held on the device until the pool is gone in both processes.
    let bytes = 64 << 20;
    let (ptr, _) = s.pooled(bytes, 0x0707_0707);
    s.pool.free(ptr, s.stream).unwrap();
    s.driver.stream_synchronize(s.stream).unwrap();
    s.pool.trim().unwrap();
    assert_eq!(
        before - free(&s),
        bytes,
        "exported, freed, trimmed: still held"
    );
    let r = s.pool.rotate().unwrap().expect("exported: rotates");
    let device = s.driver.device_info(0).unwrap().uuid;
    let fd = s.pool.fd();
    s.conn
        .send(
            &Message::ExtraPool(poolipc::advanced::transport::ExtraPool { index: 7, device }),
            &[fd.as_fd()],
            deadline(),
        )
        .unwrap();
    match s.recv() {
        Message::ExtraPoolReply(a) => assert!(a.index == 7 && a.reachable, "{a:?}"),
        m => panic!("expected the answer to ExtraPool 7, got {m:?}"),
    }
    // The Hello pool (index 0) is retired; an index never given is answered too.
    for index in [0, 9] {
        s.send(Message::PoolRetire(
            poolipc::advanced::transport::PoolRetire { index },
        ));
        assert_eq!(
            s.recv(),
            Message::PoolRetired(poolipc::advanced::transport::PoolRetire { index })
        );
    }
    s.pool.destroy_retired(r.retired).unwrap();
    assert_eq!(free(&s), before, "the retired pool's memory came back");
    s.end();
}
