//! A worker that is slow on its socket, or hostile there, harms only itself ("the IO
//! loop never waits on one worker"): the parent's one IO thread reads what has come and
//! writes what a socket takes, so frames sent a piece at a time, a worker that never reads
//! and descriptors dripped onto a slow frame stall no other worker, `spawn` or `submit`, hold
//! no more than a bound, and condemn that worker alone.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Result, bail, ensure};
use poolipc::advanced::RawDriver;
use poolipc::advanced::driver::{DevicePtr, OwnedStream, StreamHandle};
use poolipc::{DType, Error, Input, Layout, Parent, ParentOptions, SendQueueLimits, StagingConfig};
use poolipc_tests::echo;
use poolipc_tests::{Env, both_drivers, open_fds, rogue_command, worker_command};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// The staging rogue's tensor: 1 MiB in 64 KiB chunks, 16 chunks acked 300 ms apart each,
/// so its transfer lasts about 4.8 s.
const STAGED_BYTES: u64 = MIB;
const STAGING_CHUNK: u64 = 64 * KIB;
const ACK_DELAY: Duration = Duration::from_millis(300);

/// The bound on an honest worker's round trip while a rogue misbehaves beside it (a bound,
/// not a benchmark: a stalled loop takes a second or more, the rogue's delay). 500 ms, half
/// that delay: 100 ms was passed once (110 ms) on a two-core machine running two test suites
/// and a build at once, with nothing stalled.
const ROUND_TRIP_BOUND: Duration = Duration::from_millis(500);

fn parent(env: &Env, options: ParentOptions) -> Result<Parent> {
    // No canary battery: the rogues here never answer its job.
    let options = ParentOptions {
        device: env.device,
        canary: false,
        ..options
    };
    Ok(Parent::new(Arc::clone(&env.driver), options)?)
}

fn filled(p: &Parent, bytes: u64, stream: StreamHandle) -> Result<DevicePtr> {
    let ptr = p.pool().alloc(bytes, stream)?;
    echo::fill_pattern(&**p.driver(), ptr, bytes, 0x5151_7777, stream)?;
    p.driver().stream_synchronize(stream)?;
    Ok(ptr)
}

fn input(ptr: DevicePtr) -> [Input; 1] {
    [Input {
        ptr,
        desc: Layout::contiguous(DType::F32, &[KIB]),
        read_only: false,
    }]
}

/// One honest job's round trip: submit to results back (freed).
fn round_trip(
    p: &Parent,
    worker: poolipc::WorkerId,
    x: DevicePtr,
    stream: StreamHandle,
) -> Result<Duration> {
    let t = Instant::now();
    let out = p.run_job(worker, &input(x), stream)?;
    let took = t.elapsed();
    ensure!(!out.results.is_empty(), "the honest job returned no result");
    for r in &out.results {
        p.pool().free(r.ptr, stream)?;
    }
    p.driver().stream_synchronize(stream)?;
    Ok(took)
}

/// Waits until `worker` left the registry (condemned and reaped), up to `within`; how long it
/// took.
fn gone_within(p: &Parent, worker: poolipc::WorkerId, within: Duration) -> Result<Duration> {
    let t = Instant::now();
    while p.worker(worker).is_some() {
        if t.elapsed() > within {
            bail!("{worker} is still registered {within:?} on");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(t.elapsed())
}

/// The job `handle` failed as its worker's, with a detail that contains `needle`.
fn failed_naming(
    result: Result<poolipc::JobOutput, Error>,
    worker: poolipc::WorkerId,
    needle: &str,
) -> Result<String> {
    match result {
        Err(Error::JobFailed {
            worker: w, detail, ..
        }) if w == worker => {
            ensure!(
                detail.contains(needle),
                "the rogue's job failed, but not naming {needle:?}: {detail}"
            );
            Ok(detail)
        }
        Err(e) => bail!("the rogue's job failed otherwise: {e}"),
        Ok(_) => bail!("the rogue's job succeeded"),
    }
}

both_drivers!(
    /// A rogue sends valid frames a header now and the rest a second later, one after the
    /// other, never past the frame deadline (5 s). Meanwhile an honest worker's round trips
    /// stay under [`ROUND_TRIP_BOUND`], a new worker is spawned and serves, and the rogue,
    /// which broke no rule, stays registered.
    fn an_honest_workers_round_trips_stay_short_while_a_rogue_sends_slow_frames(env) {
        let p = parent(env, ParentOptions::default())?;
        let d = Arc::clone(p.driver());
        let owned_stream = OwnedStream::new(d.clone())?;
        let stream = owned_stream.handle();
        let x = filled(&p, 4 * KIB, stream)?;
        let honest = p.spawn_worker(worker_command(env, None)?)?;
        round_trip(&p, honest, x, stream)?;
        let mut rogue_cmd = rogue_command(env, "slow-frames")?;
        rogue_cmd.env("POOLIPC_TEST_ROGUE_DELAY_MS", "1000");
        let rogue = p.spawn_worker(rogue_cmd)?;
        let start = Instant::now();
        let mut worst = Duration::ZERO;
        let mut trips = 0;
        while start.elapsed() < Duration::from_millis(3500) {
            worst = worst.max(round_trip(&p, honest, x, stream)?);
            trips += 1;
            std::thread::sleep(Duration::from_millis(5));
        }
        let spawned = Instant::now();
        let second = p.spawn_worker(worker_command(env, None)?)?;
        let spawn_took = spawned.elapsed();
        round_trip(&p, second, x, stream)?;
        println!("{trips} honest round trips beside the slow rogue, the longest {worst:?}; a spawn took {spawn_took:?}");
        ensure!(
            worst < ROUND_TRIP_BOUND,
            "an honest round trip took {worst:?} beside the slow rogue (bound {ROUND_TRIP_BOUND:?})"
        );
        ensure!(p.worker(rogue).is_some(), "the rogue, which sent valid frames in time, was condemned");
        p.stop_worker(honest)?;
        p.stop_worker(second)?;
        p.pool().free(x, stream)?;
        d.stream_synchronize(stream)?;
        Ok(())
    }
);

both_drivers!(
    /// A rogue whose frame takes longer than the frame deadline (300 ms here; its payload
    /// follows its header a second later) is condemned at that deadline: its job fails naming
    /// it, it leaves the registry, and the honest worker beside it goes on.
    fn a_rogue_whose_frame_outlasts_the_frame_deadline_is_condemned_alone(env) {
        let frame_timeout = Duration::from_millis(300);
        let p = parent(env, ParentOptions { frame_timeout, ..ParentOptions::default() })?;
        let d = Arc::clone(p.driver());
        let owned_stream = OwnedStream::new(d.clone())?;
        let stream = owned_stream.handle();
        let x = filled(&p, 4 * KIB, stream)?;
        let honest = p.spawn_worker(worker_command(env, None)?)?;
        let mut rogue_cmd = rogue_command(env, "slow-frames")?;
        rogue_cmd.env("POOLIPC_TEST_ROGUE_DELAY_MS", "1000");
        let rogue = p.spawn_worker(rogue_cmd)?;
        let spawned = Instant::now();
        // Sent before the rogue's first header (it waits 200 ms): the job is the rogue's when
        // it is condemned.
        let job = p.submit(rogue, &input(x), stream)?;
        let mut worst = Duration::ZERO;
        while p.worker(rogue).is_some() && spawned.elapsed() < Duration::from_secs(3) {
            worst = worst.max(round_trip(&p, honest, x, stream)?);
        }
        let took = gone_within(&p, rogue, Duration::from_secs(3))?;
        let detail = failed_naming(job.wait(), rogue, "not done within")?;
        println!("the rogue was gone {:?} after its spawn: {detail}", spawned.elapsed());
        let _ = took;
        ensure!(
            spawned.elapsed() >= frame_timeout,
            "the rogue was condemned before its frame deadline"
        );
        ensure!(worst < ROUND_TRIP_BOUND, "an honest round trip took {worst:?}");
        round_trip(&p, honest, x, stream)?;
        p.stop_worker(honest)?;
        p.pool().free(x, stream)?;
        d.stream_synchronize(stream)?;
        Ok(())
    }
);

both_drivers!(
    /// A worker that never reads: the parent's frames to it (a `Lend` per job) queue once its
    /// socket is full, and it is condemned when its queue passes the bound (64 frames here).
    /// Meanwhile the honest worker's round trips stay short and `spawn` works: the IO thread
    /// never waits on the rogue.
    fn a_worker_that_never_reads_is_condemned_at_its_send_queue_bound_and_blocks_no_one(env) {
        let options = ParentOptions {
            tuning: poolipc::Tuning {
                send_queue: SendQueueLimits {
                    max_frames: 64,
                    ..SendQueueLimits::default()
                },
                ..poolipc::Tuning::from_env()
            },
            ..ParentOptions::default()
        };
        let p = parent(env, options)?;
        let d = Arc::clone(p.driver());
        let owned_stream = OwnedStream::new(d.clone())?;
        let stream = owned_stream.handle();
        let x = filled(&p, 4 * KIB, stream)?;
        let honest = p.spawn_worker(worker_command(env, None)?)?;
        round_trip(&p, honest, x, stream)?;
        let rogue = p.spawn_worker(rogue_command(env, "never-read")?)?;
        let start = Instant::now();
        let mut jobs = Vec::new();
        let mut worst = Duration::ZERO;
        let mut refused = false;
        for i in 0..20_000 {
            match p.submit(rogue, &input(x), stream) {
                Ok(job) => jobs.push(job),
                Err(Error::UnknownWorker(w)) if w == rogue => {
                    refused = true;
                    break;
                }
                Err(e) => bail!("submitting to the rogue failed otherwise: {e}"),
            }
            if i % 50 == 0 {
                worst = worst.max(round_trip(&p, honest, x, stream)?);
            }
        }
        ensure!(refused, "20 000 jobs were queued for a worker that never reads");
        let submitted = jobs.len();
        println!("{submitted} jobs submitted to the rogue before it was gone ({:?})", start.elapsed());
        let spawned = Instant::now();
        let second = p.spawn_worker(worker_command(env, None)?)?;
        let spawn_took = spawned.elapsed();
        round_trip(&p, second, x, stream)?;
        gone_within(&p, rogue, Duration::from_secs(5))?;
        let mut named = None;
        for job in jobs {
            if let Ok(detail) = failed_naming(job.wait(), rogue, "send queue is full") {
                named.get_or_insert(detail);
            }
        }
        let Some(detail) = named else {
            bail!("no job of the rogue's failed naming its full send queue");
        };
        println!("the rogue: {detail}; honest round trips at most {worst:?}; a spawn took {spawn_took:?}");
        ensure!(worst < ROUND_TRIP_BOUND, "an honest round trip took {worst:?}");
        p.stop_worker(honest)?;
        p.stop_worker(second)?;
        p.pool().free(x, stream)?;
        d.stream_synchronize(stream)?;
        Ok(())
    }
);

both_drivers!(
    /// A rogue drips a valid 1 KiB frame one byte a millisecond, a descriptor on each byte:
    /// the parent holds at most [`poolipc::advanced::transport::PARTIAL_FD_SLACK`] more than
    /// the frame carries (the process's descriptors stay within 16 of the baseline) and
    /// condemns the rogue at once, closing them.
    fn descriptors_dripped_onto_a_slow_frame_stay_bounded_and_condemn_the_worker(env) {
        let p = parent(env, ParentOptions::default())?;
        let d = Arc::clone(p.driver());
        let owned_stream = OwnedStream::new(d.clone())?;
        let stream = owned_stream.handle();
        let x = filled(&p, 4 * KIB, stream)?;
        let honest = p.spawn_worker(worker_command(env, None)?)?;
        round_trip(&p, honest, x, stream)?;
        let rogue = p.spawn_worker(rogue_command(env, "fd-drip")?)?;
        // The rogue waits 200 ms before its first byte.
        let baseline = open_fds()?;
        let start = Instant::now();
        let mut most = baseline;
        while p.worker(rogue).is_some() && start.elapsed() < Duration::from_secs(6) {
            most = most.max(open_fds()?);
            std::thread::sleep(Duration::from_millis(2));
        }
        most = most.max(open_fds()?);
        println!("descriptors: baseline {baseline}, most {most}; the rogue gone after {:?}", start.elapsed());
        ensure!(most <= baseline + 16, "the parent held {} descriptors over its baseline", most - baseline);
        gone_within(&p, rogue, Duration::from_secs(1))?;
        ensure!(
            start.elapsed() < Duration::from_secs(2),
            "the rogue dripped for {:?} before it was condemned",
            start.elapsed()
        );
        round_trip(&p, honest, x, stream)?;
        p.stop_worker(honest)?;
        p.pool().free(x, stream)?;
        d.stream_synchronize(stream)?;
        Ok(())
    }
);

/// A parent whose host staging moves [`STAGING_CHUNK`]-byte chunks, with a rogue beside an
/// honest worker; the rogue's 1 MiB job submitted (it stages) and its transfer started.
struct StagingRogue {
    p: Parent,
    stream: StreamHandle,
    x: DevicePtr,
    big: DevicePtr,
    honest: poolipc::WorkerId,
    rogue: poolipc::WorkerId,
    job: poolipc::JobHandle,
    /// When the rogue's job was submitted.
    submitted: Instant,
}

fn staging_rogue(env: &Env, options: ParentOptions) -> Result<StagingRogue> {
    staging_rogue_in(env, options, "staging-slow", ACK_DELAY)
}

/// [`staging_rogue`] with the rogue of `mode` and its `POOLIPC_TEST_ROGUE_DELAY_MS` of
/// `delay`; the options' staging config but for its chunk.
fn staging_rogue_in(
    env: &Env,
    options: ParentOptions,
    mode: &str,
    delay: Duration,
) -> Result<StagingRogue> {
    let staging = StagingConfig {
        chunk: usize::try_from(STAGING_CHUNK)?,
        ..options.staging.clone()
    };
    let options = ParentOptions { staging, ..options };
    let p = parent(env, options)?;
    let stream = OwnedStream::new(p.driver().clone())?.into_raw();
    let x = filled(&p, 4 * KIB, stream)?;
    let big = filled(&p, STAGED_BYTES, stream)?;
    let honest = p.spawn_worker(worker_command(env, None)?)?;
    round_trip(&p, honest, x, stream)?;
    let mut rogue_cmd = rogue_command(env, mode)?;
    rogue_cmd.env("POOLIPC_TEST_ROGUE_DELAY_MS", delay.as_millis().to_string());
    let rogue = p.spawn_worker(rogue_cmd)?;
    let submitted = Instant::now();
    let staged = [Input {
        ptr: big,
        desc: Layout::contiguous(DType::F32, &[STAGED_BYTES / 4]),
        read_only: true,
    }];
    let job = p.submit(rogue, &staged, stream)?;
    Ok(StagingRogue {
        p,
        stream,
        x,
        big,
        honest,
        rogue,
        job,
        submitted,
    })
}

/// The whole staged transfer's length at the rogue's pace.
fn staged_transfer_time() -> Duration {
    ACK_DELAY * u32::try_from(STAGED_BYTES / STAGING_CHUNK).unwrap_or(u32::MAX)
}

both_drivers!(
    /// A rogue takes host staging (it offers no pool pointers) and acks each 64 KiB chunk of
    /// its 1 MiB input 300 ms after it came: its transfer lasts about 4.8 s. Meanwhile an
    /// honest worker's round trips stay under [`ROUND_TRIP_BOUND`] and a new worker is
    /// spawned and serves: the transfer runs off the IO thread.
    fn an_honest_workers_round_trips_stay_short_while_a_rogue_acks_staged_chunks_slowly(env) {
        let s = staging_rogue(env, ParentOptions::default())?;
        let p = &s.p;
        let transfer = staged_transfer_time();
        // The bound (500 ms) is under a tenth of the transfer (4.8 s): a loop that ran the
        // transfer itself holds the first honest round trip for the rest of it, seconds.
        ensure!(ROUND_TRIP_BOUND < transfer / 2, "the transfer is too short to tell");
        let mut worst = Duration::ZERO;
        let mut trips = 0;
        while s.submitted.elapsed() < Duration::from_millis(2000) {
            worst = worst.max(round_trip(p, s.honest, s.x, s.stream)?);
            trips += 1;
            std::thread::sleep(Duration::from_millis(5));
        }
        let spawned = Instant::now();
        let second = p.spawn_worker(worker_command(env, None)?)?;
        let spawn_took = spawned.elapsed();
        round_trip(p, second, s.x, s.stream)?;
        let during = s.submitted.elapsed();
        println!("{trips} honest round trips beside the staging rogue, the longest {worst:?}; a spawn took {spawn_took:?}; {during:?} into a {transfer:?} transfer");
        ensure!(
            worst < ROUND_TRIP_BOUND,
            "an honest round trip took {worst:?} beside the staging rogue (bound {ROUND_TRIP_BOUND:?})"
        );
        ensure!(
            spawn_took < ROUND_TRIP_BOUND,
            "a spawn took {spawn_took:?} beside the staging rogue"
        );
        ensure!(during < transfer, "the round trips did not all run during the transfer");
        ensure!(p.worker(s.rogue).is_some(), "the rogue, which broke no rule, was condemned");
        p.stop_worker(s.honest)?;
        p.stop_worker(second)?;
        p.stop_worker(s.rogue)?;
        let _ = s.job.wait();
        p.pool().free(s.x, s.stream)?;
        p.pool().free(s.big, s.stream)?;
        p.driver().stream_synchronize(s.stream)?;
        Ok(())
    }
);

both_drivers!(
    /// A worker stopped while its staged transfer runs (slowly: 4.8 s) is killed at its stop
    /// deadline (300 ms here) rather than after the transfer: `stop_worker` returns within a
    /// second, the worker's job fails, and the honest worker beside it serves on.
    fn a_worker_stopped_during_its_staged_transfer_is_killed_at_its_stop_deadline(env) {
        let options = ParentOptions {
            stop_timeout: Duration::from_millis(300),
            ..ParentOptions::default()
        };
        let s = staging_rogue(env, options)?;
        let p = &s.p;
        // Well into the transfer: a few chunks acked.
        std::thread::sleep(Duration::from_millis(700));
        let stopping = Instant::now();
        p.stop_worker(s.rogue)?;
        let took = stopping.elapsed();
        let r = s.job.wait();
        println!("the rogue stopped {took:?} after stop_worker, {:?} into its transfer: {:?}", s.submitted.elapsed(), r.as_ref().err());
        ensure!(took < Duration::from_secs(1), "stopping the rogue took {took:?}");
        ensure!(r.is_err(), "the stopped worker's staged job succeeded");
        ensure!(p.worker(s.rogue).is_none(), "the stopped worker is still listed");
        round_trip(p, s.honest, s.x, s.stream)?;
        p.stop_worker(s.honest)?;
        p.pool().free(s.x, s.stream)?;
        p.pool().free(s.big, s.stream)?;
        p.driver().stream_synchronize(s.stream)?;
        Ok(())
    }
);

both_drivers!(
    /// A parent dropped while a worker's staged transfer runs (slowly: 4.8 s) does not wait
    /// it out: the worker is killed at the stop deadline (300 ms here), the drop returns
    /// within a second and the worker's job fails.
    fn a_parent_dropped_during_a_staged_transfer_ends_it_at_the_stop_deadline(env) {
        let options = ParentOptions {
            stop_timeout: Duration::from_millis(300),
            ..ParentOptions::default()
        };
        let s = staging_rogue(env, options)?;
        std::thread::sleep(Duration::from_millis(700));
        let StagingRogue { p, job, .. } = s;
        let dropping = Instant::now();
        drop(p);
        let took = dropping.elapsed();
        let r = job.wait();
        println!("the parent dropped in {took:?}: {:?}", r.as_ref().err());
        ensure!(took < Duration::from_secs(1), "dropping the parent took {took:?}");
        ensure!(r.is_err(), "the staged job succeeded though its parent was dropped");
        Ok(())
    }
);

both_drivers!(
    /// A worker silent about its job past the handoff timeout (1 s here) while its staged
    /// transfer runs (slowly: 4.8 s; chunk acks are the channel's, not the job's) is
    /// condemned at that timeout, not after the transfer: it leaves the registry well before
    /// the transfer's end, its job fails, and the honest worker serves on.
    fn a_worker_condemned_during_its_staged_transfer_is_killed_then(env) {
        let options = ParentOptions {
            handoff_timeout: Duration::from_secs(1),
            ..ParentOptions::default()
        };
        let s = staging_rogue(env, options)?;
        let p = &s.p;
        gone_within(p, s.rogue, Duration::from_secs(3))?;
        let gone = s.submitted.elapsed();
        let r = s.job.wait();
        println!("the rogue was gone {gone:?} after its submit: {:?}", r.as_ref().err());
        ensure!(gone < staged_transfer_time() / 2, "the rogue was gone only {gone:?} after its submit");
        ensure!(r.is_err(), "the condemned worker's staged job succeeded");
        round_trip(p, s.honest, s.x, s.stream)?;
        p.stop_worker(s.honest)?;
        p.pool().free(s.x, s.stream)?;
        p.pool().free(s.big, s.stream)?;
        p.driver().stream_synchronize(s.stream)?;
        Ok(())
    }
);

/// The staging timeout of the tests of a worker whose GPU work hangs under its transfer: 10 s,
/// the time a transfer waiting on that work took to end before the loop could abort it; the
/// tests' bound on their stop or drop is [`ABORT_BOUND`], far below it.
const HUNG_STAGING_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a stop or a drop may take when a transfer waits on a worker's hung GPU work: the
/// stop deadline (300 ms) and the reaping, with room for a loaded two-core machine; a fifth of
/// [`HUNG_STAGING_TIMEOUT`], so a stop that waited the transfer's wait out cannot pass.
const ABORT_BOUND: Duration = Duration::from_secs(2);

fn hung_options() -> ParentOptions {
    ParentOptions {
        stop_timeout: Duration::from_millis(300),
        staging: StagingConfig {
            timeout: HUNG_STAGING_TIMEOUT,
            ..StagingConfig::default()
        },
        ..ParentOptions::default()
    }
}

both_drivers!(
    /// A rogue acks its staged chunks at once but records each half's `drained` event behind
    /// a kernel that never ends: the transfer's thread polls that event on the host, where
    /// shutting the socket down does not reach it. Stopped then, the worker is killed at its
    /// stop deadline (300 ms) and the wait aborted: `stop_worker` returns within
    /// [`ABORT_BOUND`] (2 s), not at the staging timeout (10 s here), the job fails, and the
    /// honest worker beside it serves on.
    fn a_worker_stopped_while_its_transfer_waits_on_its_hung_gpu_work_stops_at_its_deadline(env) {
        let s = staging_rogue_in(env, hung_options(), "staging-gpu-hang", ACK_DELAY)?;
        let p = &s.p;
        // The transfer is in its wait for the first half's `drained` by now.
        std::thread::sleep(Duration::from_millis(500));
        let stopping = Instant::now();
        p.stop_worker(s.rogue)?;
        let took = stopping.elapsed();
        let r = s.job.wait();
        println!("the rogue stopped {took:?} after stop_worker: {:?}", r.as_ref().err());
        ensure!(took < ABORT_BOUND, "stopping the rogue took {took:?}");
        ensure!(r.is_err(), "the stopped worker's staged job succeeded");
        ensure!(p.worker(s.rogue).is_none(), "the stopped worker is still listed");
        round_trip(p, s.honest, s.x, s.stream)?;
        p.stop_worker(s.honest)?;
        p.pool().free(s.x, s.stream)?;
        p.pool().free(s.big, s.stream)?;
        p.driver().stream_synchronize(s.stream)?;
        Ok(())
    }
);

both_drivers!(
    /// As above, the parent dropped instead: the drop returns within [`ABORT_BOUND`] (2 s),
    /// not at the staging timeout (10 s here), and the job fails.
    fn a_parent_dropped_while_a_transfer_waits_on_hung_gpu_work_ends_it_at_the_stop_deadline(env) {
        let s = staging_rogue_in(env, hung_options(), "staging-gpu-hang", ACK_DELAY)?;
        std::thread::sleep(Duration::from_millis(500));
        let StagingRogue { p, job, .. } = s;
        let dropping = Instant::now();
        drop(p);
        let took = dropping.elapsed();
        let r = job.wait();
        println!("the parent dropped in {took:?}: {:?}", r.as_ref().err());
        ensure!(took < ABORT_BOUND, "dropping the parent took {took:?}");
        ensure!(r.is_err(), "the staged job succeeded though its parent was dropped");
        Ok(())
    }
);

/// How late the `staging-late-ready` rogue answers the staging setup: 2 s.
const READY_DELAY: Duration = Duration::from_secs(2);

both_drivers!(
    /// A rogue answers the staging setup ([`poolipc::StagingConfig`]'s buffer) only
    /// [`READY_DELAY`] (2 s) after it came. Meanwhile an honest worker's round trips stay
    /// under [`ROUND_TRIP_BOUND`] (500 ms, a quarter of the delay: a loop that waited for
    /// the answer itself holds the first round trip for the rest of it). The late answer is
    /// within the staging timeout: the setup succeeds and the rogue's job goes on (lent, its
    /// input sent; the rogue never finishes it), its worker listed.
    fn an_honest_workers_round_trips_stay_short_while_a_rogue_answers_the_staging_setup_late(env) {
        let s = staging_rogue_in(env, ParentOptions::default(), "staging-late-ready", READY_DELAY)?;
        let p = &s.p;
        ensure!(ROUND_TRIP_BOUND < READY_DELAY / 2, "the delay is too short to tell");
        let mut worst = Duration::ZERO;
        let mut trips = 0;
        while s.submitted.elapsed() < READY_DELAY - Duration::from_millis(300) {
            worst = worst.max(round_trip(p, s.honest, s.x, s.stream)?);
            trips += 1;
            std::thread::sleep(Duration::from_millis(5));
        }
        let during = s.submitted.elapsed();
        println!("{trips} honest round trips while the rogue's staging setup waited, the longest {worst:?}; {during:?} into a {READY_DELAY:?} delay");
        ensure!(
            worst < ROUND_TRIP_BOUND,
            "an honest round trip took {worst:?} while the rogue's staging setup waited (bound {ROUND_TRIP_BOUND:?})"
        );
        ensure!(trips > 1, "only {trips} round trips ran during the delay");
        // Past the answer: a failed setup would have failed the job and let the worker go.
        while s.submitted.elapsed() < READY_DELAY + Duration::from_millis(500) {
            std::thread::sleep(Duration::from_millis(10));
        }
        ensure!(!s.job.is_finished(), "the rogue's job ended: {:?}", s.job.wait().err());
        ensure!(p.worker(s.rogue).is_some(), "the rogue, which broke no rule, was condemned");
        p.stop_worker(s.honest)?;
        p.stop_worker(s.rogue)?;
        let _ = s.job.wait();
        p.pool().free(s.x, s.stream)?;
        p.pool().free(s.big, s.stream)?;
        p.driver().stream_synchronize(s.stream)?;
        Ok(())
    }
);

both_drivers!(
    /// As above, but what needs host staging is a result: the rogue (no pool pointers, no
    /// arena) asks for a 4 KiB result in a job without inputs, and answers the staging setup
    /// that result needs [`READY_DELAY`] late. The setup runs off the loop, as an input's
    /// does: an honest worker's round trips meanwhile stay under [`ROUND_TRIP_BOUND`] (a loop
    /// that waited for the answer itself held one for the rest of the delay: 2.0 s before
    /// this test's change), and once the answer came the result was allocated, by host
    /// staging, and granted.
    fn an_honest_workers_round_trips_stay_short_while_a_rogue_answers_a_results_staging_setup_late(
        env
    ) {
        let p = parent(env, ParentOptions::default())?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let x = filled(&p, 4 * KIB, stream)?;
        let honest = p.spawn_worker(worker_command(env, None)?)?;
        round_trip(&p, honest, x, stream)?;
        let mut rogue_cmd = rogue_command(env, "staging-late-result")?;
        rogue_cmd.env("POOLIPC_TEST_ROGUE_DELAY_MS", READY_DELAY.as_millis().to_string());
        let rogue = p.spawn_worker(rogue_cmd)?;
        let staged_before = p.stats().host_staged_tensors;
        let submitted = Instant::now();
        let job = p.submit(rogue, &[], stream)?;
        let mut worst = Duration::ZERO;
        let mut trips = 0;
        while submitted.elapsed() < READY_DELAY - Duration::from_millis(300) {
            worst = worst.max(round_trip(&p, honest, x, stream)?);
            trips += 1;
            std::thread::sleep(Duration::from_millis(5));
        }
        println!(
            "{trips} honest round trips while the rogue's result waited for its staging setup, the longest {worst:?}"
        );
        ensure!(
            worst < ROUND_TRIP_BOUND,
            "an honest round trip took {worst:?} while the rogue's staging setup waited (bound {ROUND_TRIP_BOUND:?})"
        );
        ensure!(trips > 1, "only {trips} round trips ran during the delay");
        ensure!(
            p.stats().host_staged_tensors == staged_before,
            "the result was allocated before its staging setup was answered"
        );
        // Past the answer: the result is allocated by host staging and granted.
        let until = Instant::now() + Duration::from_secs(5);
        while p.stats().host_staged_tensors == staged_before && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        ensure!(
            p.stats().host_staged_tensors == staged_before + 1,
            "no host-staged result after the setup was answered ({} before, {} now)",
            staged_before,
            p.stats().host_staged_tensors
        );
        ensure!(!job.is_finished(), "the rogue's job ended: {:?}", job.wait().err());
        ensure!(p.worker(rogue).is_some(), "the rogue, which broke no rule, was condemned");
        p.stop_worker(honest)?;
        p.stop_worker(rogue)?;
        let _ = job.wait();
        p.pool().free(x, stream)?;
        p.driver().stream_synchronize(stream)?;
        Ok(())
    }
);

both_drivers!(
    /// The same rogue answering past the staging timeout (1 s here, its answer 2 s late):
    /// the setup fails off the loop, the result it was for is refused rather than set up
    /// again, the rogue's job fails and the rogue is let go, and the honest worker serves on.
    fn a_results_staging_setup_past_its_timeout_fails_that_job_alone(env) {
        let options = ParentOptions {
            staging: StagingConfig {
                timeout: Duration::from_secs(1),
                ..StagingConfig::default()
            },
            ..ParentOptions::default()
        };
        let p = parent(env, options)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let x = filled(&p, 4 * KIB, stream)?;
        let honest = p.spawn_worker(worker_command(env, None)?)?;
        let mut rogue_cmd = rogue_command(env, "staging-late-result")?;
        rogue_cmd.env("POOLIPC_TEST_ROGUE_DELAY_MS", READY_DELAY.as_millis().to_string());
        let rogue = p.spawn_worker(rogue_cmd)?;
        let t = Instant::now();
        let job = p.submit(rogue, &[], stream)?;
        match job.wait() {
            Ok(_) => bail!("the rogue's job succeeded without a staging setup"),
            Err(e) => println!("the rogue's job failed after {:?}: {e}", t.elapsed()),
        }
        ensure!(
            t.elapsed() < READY_DELAY + Duration::from_secs(3),
            "the job took {:?} to fail",
            t.elapsed()
        );
        round_trip(&p, honest, x, stream)?;
        p.stop_worker(honest)?;
        let _ = p.stop_worker(rogue);
        p.pool().free(x, stream)?;
        p.driver().stream_synchronize(stream)?;
        Ok(())
    }
);

both_drivers!(
    /// A caller's result allocator that takes its time (a Python allocator waiting for the
    /// GIL, torch freeing its cache to find room) holds up only its own job: it runs off the
    /// IO thread, so another worker's round trips meanwhile stay short, and the slow job
    /// still gets the memory it made.
    fn a_slow_result_allocator_holds_up_no_other_worker(env) {
        let p = parent(env, ParentOptions::default())?;
        let slow_worker = p.spawn_worker(worker_command(env, None)?)?;
        let other = p.spawn_worker(worker_command(env, None)?)?;
        let stream = StreamHandle::NULL;
        let x = filled(&p, 4 * KIB, stream)?;
        let (entered_tx, entered_rx) = std::sync::mpsc::channel::<()>();
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let (driver, pool) = (Arc::clone(p.driver()), p.pool().handle());
        let made = Arc::new(std::sync::Mutex::new(Vec::new()));
        let made_in = Arc::clone(&made);
        let alloc: poolipc::ResultAllocator = Box::new(move |_shape, bytes, stream| {
            let _ = entered_tx.send(());
            // Held until the test has run the other worker's jobs (or two seconds).
            let _ = release_rx.recv_timeout(Duration::from_secs(2));
            let ptr = driver.mem_alloc_from_pool_async(bytes, pool, stream)?;
            made_in
                .lock()
                .map_err(|_| Error::Config("poisoned".into()))?
                .push(ptr);
            Ok(ptr)
        });
        let slow = p.submit_with(slow_worker, &input(x), stream, alloc)?;
        entered_rx
            .recv_timeout(Duration::from_secs(10))
            .map_err(|_| anyhow::anyhow!("the slow allocator was never called"))?;
        // The allocator is inside its wait: the other worker's round trips go on meanwhile.
        let mut worst = Duration::ZERO;
        for _ in 0..5 {
            worst = worst.max(round_trip(&p, other, x, stream)?);
        }
        let _ = release_tx.send(());
        let out = slow.wait()?;
        println!("the other worker's round trips while the allocator waited: the longest {worst:?}");
        ensure!(
            worst < ROUND_TRIP_BOUND,
            "a round trip on another worker took {worst:?} while one job's allocator waited"
        );
        let made = made.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.clone();
        ensure!(
            out.results.iter().map(|r| r.ptr).eq(made.iter().copied()),
            "the slow job's results are not what its allocator made: {:?} against {made:?}",
            out.results.iter().map(|r| r.ptr).collect::<Vec<_>>()
        );
        for r in &out.results {
            p.pool().free(r.ptr, stream)?;
        }
        p.pool().free(x, stream)?;
        p.driver().stream_synchronize(stream)?;
        Ok(())
    }
);

both_drivers!(
    /// A rogue sending valid frames as fast as its socket takes them gets its turn like any
    /// other worker (a bounded number of frames per turn of the IO loop): an honest worker's
    /// round trips beside it stay short, and the parent lets the rogue go at its stop.
    fn an_honest_workers_round_trips_stay_short_while_a_rogue_floods_heartbeats(env) {
        let p = parent(env, ParentOptions::default())?;
        let honest = p.spawn_worker(worker_command(env, None)?)?;
        let rogue = p.spawn_worker(rogue_command(env, "heartbeat-flood")?)?;
        let stream = StreamHandle::NULL;
        let x = filled(&p, 4 * KIB, stream)?;
        // The flood fills the rogue's socket first.
        std::thread::sleep(Duration::from_millis(200));
        let (mut worst, started) = (Duration::ZERO, Instant::now());
        let mut trips = 0;
        while started.elapsed() < Duration::from_secs(1) {
            worst = worst.max(round_trip(&p, honest, x, stream)?);
            trips += 1;
        }
        println!("{trips} honest round trips beside the flood, the longest {worst:?}");
        ensure!(
            worst < ROUND_TRIP_BOUND,
            "an honest round trip took {worst:?} beside a heartbeat flood (bound {ROUND_TRIP_BOUND:?})"
        );
        let stopped = Instant::now();
        let _ = p.stop_worker(rogue);
        ensure!(
            stopped.elapsed() < Duration::from_secs(10),
            "stopping the flooding rogue took {:?}",
            stopped.elapsed()
        );
        p.pool().free(x, stream)?;
        p.stop_worker(honest)?;
        Ok(())
    }
);
