//! What the bench measures and how: one function per section of the table, each timing its
//! round trips on the parent and worker that [`Bench`] names, and the helpers they share.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use poolipc::advanced::driver::Driver;
use poolipc::advanced::pool::ImportLimit;
use poolipc::{DType, Input, Layout, Parent, ParentOptions, Rung, Trust};

use super::{Args, KIB, MIB, human, peers};

/// The result sizes measured through the arena.
const RESULT_SIZES: [u64; 6] = [4 << 10, 1 << 20, 64 << 20, 1 << 30, 4 << 30, 16 << 30];

/// What every section measures on: the parent, its worker, the stream the jobs run on.
#[derive(Clone, Copy)]
pub(super) struct Bench<'a> {
    pub(super) args: &'a Args,
    /// The simulated driver: its device memory is this machine's memory (smaller sizes).
    pub(super) sim: bool,
    pub(super) parent: &'a Parent,
    pub(super) d: &'a dyn Driver,
    /// The worker that writes 4 KiB into each tensor it is lent.
    pub(super) worker: poolipc::WorkerId,
    pub(super) stream: poolipc::StreamHandle,
    /// What a worker needs in its environment to open the same driver.
    pub(super) child_env: &'a Option<(&'static str, String)>,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

/// One size of the round-trip table: the one tensor's round trips, each way it is lent.
pub(super) struct Row {
    pub(super) bytes: u64,
    pub(super) first_us: f64,
    pub(super) recycled_us: f64,
    /// The 90th percentile of the recycled round trips: how much the median can be trusted.
    pub(super) recycled_p90_us: f64,
    /// Of the recycled round trip, the wait after the job returned (its DONE frame handled)
    /// until the caller's stream is done: the GPU's part, like the floor's gate.
    pub(super) recycled_gpu_wait_us: f64,
    /// Recycled lends (after the first) served with the cached blob: no export (export
    /// reuse proven), out of `recycled_lends`.
    pub(super) recycled_reused: u64,
    pub(super) recycled_lends: u64,
    /// The same live allocation lent again: the export cache's hit.
    pub(super) relend_us: f64,
    pub(super) staging_us: f64,
    pub(super) host_copy_us: f64,
}

/// Round trips per size: enough for a steady median, bounded for the large sizes.
fn iterations_for(args: &Args, bytes: u64) -> usize {
    args.iterations.unwrap_or(match bytes {
        b if b <= MIB => 400,
        b if b <= 64 * MIB => 200,
        b if b <= 1024 * MIB => 50,
        _ => 20,
    })
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    let i = ((v.len() - 1) as f64 * p).round() as usize;
    v[i.min(v.len() - 1)]
}

/// The parent the bench lends from: results through an arena it keeps for the whole run.
pub(super) fn parent(driver: &Arc<dyn Driver>, device: u32) -> Result<Parent> {
    let options = ParentOptions {
        device,
        canary: false,
        results: poolipc::ResultMemory::Arena {
            initial_bytes: 1 << 30,
            max_bytes: None,
        },
        // The bench sizes its rows to the device itself (a row that does not fit is
        // skipped) and keeps its arena between rows: no cap below the device, no idle
        // release in the middle of a measurement.
        arena_cap_fraction: 1.0,
        arena_idle_release: None,
        ..ParentOptions::default()
    };
    Parent::new(Arc::clone(driver), options).context("starting the parent")
}

/// Whether a row of `bytes` that needs `need` bytes of device memory fits in what the
/// device has free now (with 256 MiB to spare); if not, says so in `skipped`.
fn fits(
    d: &dyn Driver,
    what: &str,
    bytes: u64,
    need: u64,
    skipped: &mut Vec<String>,
) -> Result<bool> {
    let (free, _total) = d
        .mem_get_info()
        .context("asking the device's free memory")?;
    if need.saturating_add(256 * MIB) <= free {
        return Ok(true);
    }
    skipped.push(format!(
        "{what} of {}: needs {} of device memory, {} free",
        human(bytes),
        human(need),
        human(free)
    ));
    Ok(false)
}

/// One round trip of `input` on `worker`, timed from submit to the caller's stream done.
fn round_trip(
    parent: &Parent,
    d: &dyn Driver,
    worker: poolipc::WorkerId,
    input: &Input,
    stream: poolipc::StreamHandle,
) -> Result<(f64, poolipc::JobOutput)> {
    let (us, _wait, out) = round_trip_split(parent, d, worker, input, stream)?;
    Ok((us, out))
}

/// `first` and `second` lent to `worker` one after the other, `iterations` + 1 times (the
/// first pair a warm-up): each one's round trips, and the rung `first` took.
fn alternate(
    b: &Bench<'_>,
    worker: poolipc::WorkerId,
    first: &Input,
    second: &Input,
    iterations: usize,
) -> Result<(Vec<f64>, Vec<f64>, Option<Rung>)> {
    let (mut a, mut z, mut rung) = (Vec::new(), Vec::new(), None);
    for i in 0..=iterations {
        let (a_us, out) = round_trip(b.parent, b.d, worker, first, b.stream)?;
        rung = out.input_rungs.first().copied();
        let (z_us, _) = round_trip(b.parent, b.d, worker, second, b.stream)?;
        if i > 0 {
            a.push(a_us);
            z.push(z_us);
        }
    }
    Ok((a, z, rung))
}

/// The pool pointer's re-lend of `bytes` in `rows`, NaN where the table lacks that size.
fn relend_of(rows: &[Row], bytes: u64) -> f64 {
    rows.iter()
        .find(|r| r.bytes == bytes)
        .map_or(f64::NAN, |r| r.relend_us)
}

/// [`round_trip`], and of it the wait after the job returned until the stream is done.
fn round_trip_split(
    parent: &Parent,
    d: &dyn Driver,
    worker: poolipc::WorkerId,
    input: &Input,
    stream: poolipc::StreamHandle,
) -> Result<(f64, f64, poolipc::JobOutput)> {
    poolipc::probe::mark("rt.begin");
    let t = Instant::now();
    let out = parent.run_job(worker, std::slice::from_ref(input), stream)?;
    let returned = Instant::now();
    d.stream_synchronize(stream)?;
    poolipc::probe::mark("rt.synced");
    Ok((
        t.elapsed().as_secs_f64() * 1e6,
        returned.elapsed().as_secs_f64() * 1e6,
        out,
    ))
}

/// One tensor lent at each size from 4 KiB to 4 GiB: allocated afresh each time (recycled),
/// one live allocation lent again (re-lend), on the host-staging rung, and the host copy the
/// handoff replaces.
pub(super) fn round_trips(b: &Bench<'_>, skipped: &mut Vec<String>) -> Result<Vec<Row>> {
    let &Bench {
        args,
        sim,
        parent,
        d,
        worker,
        stream,
        ..
    } = b;
    let mut rows = Vec::new();
    for bytes in args.round_trip_sizes() {
        if bytes > args.max_mib(sim) * MIB || !fits(d, "round trip", bytes, 2 * bytes, skipped)? {
            continue;
        }
        let iterations = iterations_for(args, bytes);
        let desc = Layout::contiguous(DType::U8, &[bytes]);
        let mut times = Vec::with_capacity(iterations);
        let mut first = f64::NAN;
        let mut waits = Vec::with_capacity(iterations);
        let mut recycled_reused = 0;
        for i in 0..=iterations {
            // The same size allocated and freed each time: the first is fresh pool memory,
            // the rest recycled (a new allocation at the same address: its cached blob
            // reused once export reuse is proven, else exported again).
            let reused_before = parent.pool().export_cache_stats().reused;
            let ptr = parent
                .pool()
                .alloc(bytes, stream)
                .with_context(|| format!("allocating {} from the pool", human(bytes)))?;
            d.stream_synchronize(stream)?;
            let input = Input {
                ptr,
                desc: desc.clone(),
                read_only: false,
            };
            let (us, wait, _) = round_trip_split(parent, d, worker, &input, stream)?;
            if i == 0 {
                first = us;
            } else {
                times.push(us);
                waits.push(wait);
                recycled_reused += parent.pool().export_cache_stats().reused - reused_before;
            }
            parent.pool().free(ptr, stream)?;
            d.stream_synchronize(stream)?;
        }
        // One live allocation lent again and again: its export comes from the cache.
        let ptr = parent
            .pool()
            .alloc(bytes, stream)
            .with_context(|| format!("allocating {} from the pool", human(bytes)))?;
        d.stream_synchronize(stream)?;
        let input = Input {
            ptr,
            desc: desc.clone(),
            read_only: false,
        };
        let mut relends = Vec::with_capacity(iterations);
        for i in 0..=iterations {
            let (us, _) = round_trip(parent, d, worker, &input, stream)?;
            if i > 0 {
                relends.push(us);
            }
        }
        // The host-staging rung, the same round trip through pinned shared memory.
        let mut staged = super::host_staged(parent, || {
            let mut staged = Vec::new();
            for _ in 0..iterations.clamp(1, 5) {
                let (us, out) = round_trip(parent, d, worker, &input, stream)?;
                staged.push(us);
                anyhow::ensure!(
                    out.input_rungs == [Rung::HostStaging],
                    "staging was not used"
                );
            }
            Ok(staged)
        })?;
        parent.pool().free(ptr, stream)?;
        d.stream_synchronize(stream)?;
        // What the handoff replaces: device → host → device through pageable host memory.
        let src = parent
            .pool()
            .alloc(bytes, stream)
            .with_context(|| format!("allocating {} from the pool", human(bytes)))?;
        let dst = parent
            .pool()
            .alloc(bytes, stream)
            .with_context(|| format!("allocating {} from the pool", human(bytes)))?;
        d.stream_synchronize(stream)?;
        let mut host = vec![0u8; usize::try_from(bytes)?];
        let mut copies = Vec::new();
        for _ in 0..3 {
            let t = Instant::now();
            d.memcpy_dtoh(&mut host, src)?;
            d.memcpy_htod(dst, &host)?;
            copies.push(t.elapsed().as_secs_f64() * 1e6);
        }
        parent.pool().free(src, stream)?;
        parent.pool().free(dst, stream)?;
        d.stream_synchronize(stream)?;
        rows.push(Row {
            bytes,
            first_us: first,
            recycled_us: median(&mut times),
            recycled_p90_us: percentile(&mut times, 0.9),
            recycled_gpu_wait_us: median(&mut waits),
            recycled_reused,
            recycled_lends: iterations as u64,
            relend_us: median(&mut relends),
            staging_us: median(&mut staged),
            host_copy_us: median(&mut copies),
        });
    }
    Ok(rows)
}

/// Inputs above the import limit: each size lent read-only and writable by arena copy, and
/// (above 4 GiB) by host staging.
pub(super) fn arena_copies(b: &Bench<'_>, skipped: &mut Vec<String>) -> Result<Vec<CopyRow>> {
    let &Bench {
        args,
        sim,
        parent,
        d,
        worker,
        stream,
        ..
    } = b;
    // Inputs above the import limit: the arena-copy rung (one device-to-device copy into the
    // arena on the job's stream), beside host staging. Sizes up to 4 GiB are put above the
    // limit by lowering it; larger ones are above the real one.
    let mut copy_rows = Vec::new();
    for bytes in RESULT_SIZES {
        if bytes > args.copy_max_mib(sim) * MIB
            || !fits(d, "arena copy", bytes, 2 * bytes, skipped)?
        {
            continue;
        }
        let desc = Layout::contiguous(DType::U8, &[bytes]);
        let ptr = parent
            .pool()
            .alloc(bytes, stream)
            .with_context(|| format!("allocating {} from the pool", human(bytes)))?;
        d.stream_synchronize(stream)?;
        // Read-only: the worker's view is mapped read-only and nothing is copied back (what
        // this row measured before copy-back existed). The writable lend below adds the copy
        // back into the tensor after the job (one more device-to-device copy of `bytes`).
        let input = Input::new(ptr, desc).read_only();
        let writable = Input {
            read_only: false,
            ..input.clone()
        };
        let pointer_limit = parent.options().limit;
        parent.lower_import_limit(
            ImportLimit::new(pointer_limit.chunk_bytes(), 0).context("limit")?,
        )?;
        let (mut copied, mut copied_back, rung) = alternate(
            b,
            worker,
            &input,
            &writable,
            iterations_for(args, bytes).min(50),
        )?;
        // Host staging of the same tensor, for the sizes the main table does not have.
        let mut staged = Vec::new();
        if bytes > 4096 * MIB {
            parent.set_arena_copy(false);
            for _ in 0..3 {
                staged.push(round_trip(parent, d, worker, &input, stream)?.0);
            }
            parent.set_arena_copy(true);
        }
        parent.lower_import_limit(pointer_limit)?;
        parent.pool().free(ptr, stream)?;
        d.stream_synchronize(stream)?;
        parent.reclaim_arena();
        copy_rows.push(CopyRow {
            bytes,
            read_only_us: median(&mut copied),
            copy_back_us: median(&mut copied_back),
            rung,
            staged_us: median(&mut staged),
        });
    }
    Ok(copy_rows)
}

/// Device memory outside the pool: a `cuMemAlloc` tensor and a VMM tensor, compared with the
/// pool pointer's re-lend of the same size from `rows`.
pub(super) fn device_memory(
    b: &Bench<'_>,
    rows: &[Row],
    skipped: &mut Vec<String>,
) -> Result<Vec<DevMemRow>> {
    let &Bench {
        args,
        sim,
        parent,
        d,
        worker,
        stream,
        ..
    } = b;
    // Device memory outside the pool: a cuMemAlloc tensor (the arena copy) and a
    // VMM allocation made with the POSIX FD handle type (lent by handle, the worker's mapping
    // cached after the first job; writable, as the pool pointer's re-lend of the same size
    // from the table above that it is compared with). The cuMemAlloc tensor is lent
    // read-only: one device-to-device copy, none back.
    let mut devmem_rows = Vec::new();
    for bytes in [4 * KIB, 64 * MIB, 4096 * MIB] {
        if bytes > args.max_mib(sim) * MIB
            || !fits(
                d,
                "device memory outside the pool",
                bytes,
                2 * bytes,
                skipped,
            )?
        {
            continue;
        }
        let iterations = iterations_for(args, bytes).min(50);
        let desc = Layout::contiguous(DType::U8, &[bytes]);
        let plain = poolipc::advanced::driver::DeviceAllocation::new(d, bytes)
            .with_context(|| format!("cuMemAlloc of {}", human(bytes)))?;
        let mut copied = Vec::new();
        let mut copy_rung = None;
        let lent = (|| -> Result<()> {
            let input = Input::new(plain.ptr(), desc.clone()).read_only();
            for i in 0..=iterations {
                let (us, out) = round_trip(parent, d, worker, &input, stream)?;
                copy_rung = out.input_rungs.first().copied();
                if i > 0 {
                    copied.push(us);
                }
            }
            Ok(())
        })();
        d.ctx_synchronize()?;
        plain.close()?;
        lent?;
        parent.reclaim_arena();
        let vmm = VmmTensor::new(d, args.device, bytes)?;
        let mut by_handle = Vec::new();
        let mut first_handle = f64::NAN;
        let mut handle_rung = None;
        let lent = (|| -> Result<()> {
            // Writable, as the pool pointer's re-lend it is compared with: the worker writes
            // its 4 KiB into the parent's memory itself, nothing is copied back.
            let input = Input::new(vmm.ptr, desc.clone());
            for i in 0..=iterations {
                let (us, out) = round_trip(parent, d, worker, &input, stream)?;
                handle_rung = out.input_rungs.first().copied();
                if i == 0 {
                    first_handle = us;
                } else {
                    by_handle.push(us);
                }
            }
            Ok(())
        })();
        d.ctx_synchronize()?;
        vmm.free()?;
        lent?;
        let pointer_us = relend_of(rows, bytes);
        devmem_rows.push(DevMemRow {
            bytes,
            copy_us: median(&mut copied),
            copy_rung,
            handle_first_us: first_handle,
            handle_us: median(&mut by_handle),
            handle_rung,
            pointer_us,
        });
    }
    Ok(devmem_rows)
}

/// One size of the isolation table: one live pool tensor lent again and again to a worker
/// spawned [`Trust::Isolated`], against the trusted worker's pool-pointer re-lend.
pub(super) struct IsolationRow {
    pub(super) bytes: u64,
    /// Median round trip lent writable: arena copy in, the touch worker writes its 4 KiB, the
    /// block copied back after DONE.
    pub(super) writable_us: f64,
    /// Median round trip lent read-only: arena copy in, nothing back.
    pub(super) read_only_us: f64,
    /// The rung the isolated worker's input took (the arena copy, unless it could not be
    /// made).
    pub(super) rung: Option<Rung>,
    /// The trusted worker's pool-pointer re-lend of the same size in this run (writable, no
    /// copy); NaN where the table lacks it.
    pub(super) pointer_us: f64,
}

/// Isolation's cost: a second touch worker, spawned isolated beside the trusted one, lent
/// one live pool tensor of each size writable and read-only, compared with the trusted
/// worker's pool-pointer re-lend of the same size from `rows`.
pub(super) fn isolation(
    b: &Bench<'_>,
    rows: &[Row],
    skipped: &mut Vec<String>,
) -> Result<Vec<IsolationRow>> {
    let &Bench {
        args,
        sim,
        parent,
        d,
        stream,
        child_env,
        ..
    } = b;
    let sizes: Vec<u64> = [4 * KIB, MIB, 64 * MIB, 1024 * MIB]
        .into_iter()
        .filter(|&bytes| bytes <= args.max_mib(sim) * MIB)
        .collect();
    if sizes.is_empty() {
        return Ok(Vec::new());
    }
    let cmd = peers::touch_worker(args, child_env)?;
    let worker = parent
        .spawn_worker_with(cmd, Trust::Isolated)
        .context("starting the isolated worker")?;
    let measured = (|| -> Result<Vec<IsolationRow>> {
        let mut out = Vec::new();
        for bytes in sizes {
            // The pool tensor and its copy in the isolated worker's arena.
            if !fits(d, "isolated lend", bytes, 2 * bytes, skipped)? {
                continue;
            }
            let desc = Layout::contiguous(DType::U8, &[bytes]);
            let ptr = parent
                .pool()
                .alloc(bytes, stream)
                .with_context(|| format!("allocating {} from the pool", human(bytes)))?;
            d.stream_synchronize(stream)?;
            let writable = Input::new(ptr, desc);
            let read_only = writable.clone().read_only();
            let lent = alternate(
                b,
                worker,
                &writable,
                &read_only,
                iterations_for(args, bytes).min(50),
            );
            parent.pool().free(ptr, stream)?;
            d.stream_synchronize(stream)?;
            let (mut written, mut read, rung) = lent?;
            parent.reclaim_arena();
            let pointer_us = relend_of(rows, bytes);
            out.push(IsolationRow {
                bytes,
                writable_us: median(&mut written),
                read_only_us: median(&mut read),
                rung,
                pointer_us,
            });
        }
        Ok(out)
    })();
    let stopped = parent.stop_worker(worker);
    let out = measured?;
    stopped.context("stopping the isolated worker")?;
    Ok(out)
}

/// One size of the arena-result tables: the size, its median round trip asking for the
/// result, the result's rung, the median round trip carving it out of the job's arena slice,
/// and how many results were carved.
pub(super) type ArenaRow = (u64, f64, Option<Rung>, f64, u64);

/// Results through the arena, each size answered by a worker of its own: asked for with a
/// `ResultRequest`, then carved out of the job's arena slice.
pub(super) fn arena_results(b: &Bench<'_>, skipped: &mut Vec<String>) -> Result<Vec<ArenaRow>> {
    let &Bench {
        args,
        sim,
        parent,
        d,
        stream,
        child_env,
        ..
    } = b;
    // Results through the arena: a worker answering each job with one result of the size,
    // writing its first 4 KiB; the block goes back (stream-ordered) when the result drops.
    let mut arena_rows = Vec::new();
    for bytes in RESULT_SIZES {
        if bytes > args.result_max_mib(sim) * MIB
            || !fits(d, "arena result", bytes, bytes, skipped)?
        {
            continue;
        }
        let cmd = peers::demo_worker(args, child_env, &format!("result:{bytes}"))?;
        let producer = parent
            .spawn_worker(cmd)
            .context("starting the result worker")?;
        let iterations = iterations_for(args, bytes);
        let mut times = Vec::with_capacity(iterations);
        let mut rung = None;
        for i in 0..=iterations {
            let t = Instant::now();
            let out = parent.run_job(producer, &[], stream)?;
            d.stream_synchronize(stream)?;
            let us = t.elapsed().as_secs_f64() * 1e6;
            anyhow::ensure!(out.results.len() == 1, "{} results", out.results.len());
            anyhow::ensure!(out.results[0].bytes >= bytes, "a short result");
            rung = Some(out.results[0].rung);
            if i > 0 {
                times.push(us);
            }
            drop(out);
        }
        // The same result, its shape learned late, with an arena slice of its size lent with
        // each job: the worker carves it and skips the ResultRequest round trip.
        parent.set_arena_slice_bytes(bytes);
        let carved_before = parent.stats().arena_results_carved;
        let mut sliced = Vec::with_capacity(iterations);
        for i in 0..=iterations {
            let t = Instant::now();
            let out = parent.run_job(producer, &[], stream)?;
            d.stream_synchronize(stream)?;
            let us = t.elapsed().as_secs_f64() * 1e6;
            anyhow::ensure!(out.results.len() == 1, "{} results", out.results.len());
            anyhow::ensure!(out.results[0].bytes >= bytes, "a short result");
            if i > 0 {
                sliced.push(us);
            }
            drop(out);
        }
        parent.set_arena_slice_bytes(0);
        let carved = parent.stats().arena_results_carved - carved_before;
        parent.stop_worker(producer)?;
        arena_rows.push((bytes, median(&mut times), rung, median(&mut sliced), carved));
    }
    Ok(arena_rows)
}

/// The batch section: many small tensors in one job.
pub(super) struct Batch {
    /// Tensors in the job, each 4 KiB and its own allocation.
    pub(super) n: usize,
    /// The median job, in seconds.
    pub(super) batch_s: f64,
    pub(super) tensors_per_s: f64,
}

/// A batch of small tensors in one job, run ten times.
pub(super) fn batch(b: &Bench<'_>) -> Result<Batch> {
    let &Bench {
        parent,
        d,
        worker,
        stream,
        ..
    } = b;
    // A batch of 1000 small tensors, each its own allocation, in one job: fresh exports the
    // first time, the export cache's hits after.
    let n = 1000;
    let small: Vec<_> = (0..n)
        .map(|_| parent.pool().alloc(4 * KIB, stream))
        .collect::<Result<_, _>>()?;
    d.stream_synchronize(stream)?;
    let inputs: Vec<Input> = small
        .iter()
        .map(|&ptr| Input {
            ptr,
            desc: Layout::contiguous(DType::U8, &[4 * KIB]),
            read_only: false,
        })
        .collect();
    let mut batch = Vec::new();
    for _ in 0..10 {
        let t = Instant::now();
        parent.run_job(worker, &inputs, stream)?;
        d.stream_synchronize(stream)?;
        batch.push(t.elapsed().as_secs_f64());
    }
    let batch_s = median(&mut batch);
    for p in small {
        parent.pool().free(p, stream)?;
    }
    d.stream_synchronize(stream)?;
    let tensors_per_s = n as f64 / batch_s;
    Ok(Batch {
        n,
        batch_s,
        tensors_per_s,
    })
}

/// One size of the above-the-limit table: an input lent by arena copy, read-only and with
/// copy-back, and (above 4 GiB) host staging of the same tensor.
pub(super) struct CopyRow {
    pub(super) bytes: u64,
    /// Median round trip lent read-only (no copy-back).
    pub(super) read_only_us: f64,
    /// Median round trip lent writable: the block copied back after DONE.
    pub(super) copy_back_us: f64,
    pub(super) rung: Option<Rung>,
    /// Median round trip by host staging; NaN where the main table has it.
    pub(super) staged_us: f64,
}

/// One size of the device-memory table: a `cuMemAlloc` tensor and a VMM tensor with an
/// exportable handle, each lent read-only again and again.
pub(super) struct DevMemRow {
    pub(super) bytes: u64,
    /// Median round trip of the `cuMemAlloc` tensor.
    pub(super) copy_us: f64,
    pub(super) copy_rung: Option<Rung>,
    /// The VMM tensor's first round trip (its FD sent, imported and mapped).
    pub(super) handle_first_us: f64,
    /// Median round trip of the VMM tensor lent again (the worker's mapping cached).
    pub(super) handle_us: f64,
    pub(super) handle_rung: Option<Rung>,
    /// The pool pointer's re-lend of the same size in this run; NaN where the table lacks it.
    pub(super) pointer_us: f64,
}

/// A VMM allocation made with the POSIX FD handle type and mapped read-write here, as a
/// library that maps its own memory (ComfyUI's weights) makes one.
/// Dropped, or [`free`](VmmTensor::free)d, it unmaps (and frees the range) before it
/// releases the handle: the fields' order.
struct VmmTensor<'d> {
    mapping: poolipc::advanced::driver::VmmMapping<&'d dyn Driver>,
    handle: poolipc::advanced::driver::VmmAllocation<&'d dyn Driver>,
    ptr: poolipc::DevicePtr,
}

impl<'d> VmmTensor<'d> {
    fn new(d: &'d dyn Driver, device: u32, bytes: u64) -> Result<VmmTensor<'d>> {
        let g = d.vmm_granularity(device, poolipc::advanced::driver::Granularity::Minimum)?;
        let len = bytes.next_multiple_of(g.max(1));
        // What fails below undoes what succeeded: the owning values' drops.
        let handle = poolipc::advanced::driver::VmmAllocation::create(d, device, len)
            .context("cuMemCreate")?;
        let range = poolipc::advanced::driver::VmmReservation::reserve(d, len, 0)?;
        let mapping = poolipc::advanced::driver::VmmMapping::map(range, handle.handle())?;
        mapping.set_access(device, poolipc::advanced::driver::Access::ReadWrite)?;
        let ptr = mapping.ptr();
        Ok(VmmTensor {
            mapping,
            handle,
            ptr,
        })
    }

    fn free(self) -> Result<()> {
        self.mapping.close()?;
        self.handle.close()?;
        Ok(())
    }
}
