//! The foundation's behaviour, in one process and across two, on both drivers.

use std::sync::Arc;

use anyhow::{Result, ensure};
use poolipc::advanced::driver::{
    CuCode, DevicePtr, Driver, DriverKind, EventBlob, EventHandle, Granularity, OwnedEvent,
    OwnedPool, OwnedStream, PoolSharing, StreamHandle,
};
use poolipc::advanced::pool::SharedPool;
use poolipc_tests::{Env, both_drivers, hex, num, spawn_child};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn install(env: &Env) -> Result<SharedPool<dyn Driver>> {
    Ok(SharedPool::install(Arc::clone(&env.driver), env.device)?)
}

/// Fills `[ptr, ptr+bytes)` with `pattern` on `stream` and records `event` after it.
fn fill_then_record(
    d: &dyn Driver,
    ptr: DevicePtr,
    bytes: u64,
    pattern: u32,
    stream: StreamHandle,
    event: EventHandle,
) -> Result<()> {
    d.memset_d32_async(ptr, pattern, bytes / 4, stream)?;
    d.event_record(event, stream)?;
    Ok(())
}

/// Reads `len` bytes at `ptr + offset` and counts words that are not `pattern`.
fn bad_words(
    d: &dyn Driver,
    ptr: DevicePtr,
    offset: u64,
    len: usize,
    pattern: u32,
) -> Result<usize> {
    let mut buf = vec![0u8; len];
    d.memcpy_dtoh(&mut buf, ptr.offset(offset))?;
    Ok(poolipc_tests::child::count_bad(&buf, pattern).0)
}

both_drivers!(
    fn after_install_allocations_from_the_current_pool_come_from_ours(env) {
        let pool = install(env)?;
        let d = &*env.driver;
        let owned_stream = OwnedStream::new(d)?;
        let stream = owned_stream.handle();
        let current = d.device_get_mem_pool(env.device)?;
        ensure!(current == pool.handle(), "the device's current pool is not ours");
        let alloc = poolipc::advanced::driver::PoolAllocation::new(d, MIB, stream)?;
        ensure!(d.pointer_get_mempool(alloc.ptr())? == pool.handle(), "allocation came from another pool");
        alloc.free(stream)?;
        d.stream_synchronize(stream)?;
        Ok(())
    }
);

both_drivers!(
    fn pointer_export_fails_before_the_pool_fd_export_and_succeeds_after(env) {
        let d = &*env.driver;
        let owned_stream = OwnedStream::new(d)?;
        let stream = owned_stream.handle();
        let owned_pool = OwnedPool::create(d, env.device, PoolSharing::PosixFd)?;
        let pool = owned_pool.handle();
        let alloc = poolipc::advanced::driver::PoolAllocation::from_pool(d, MIB, pool, stream)?;
        let ptr = alloc.ptr();
        d.stream_synchronize(stream)?;
        let err = d.mem_pool_export_pointer(ptr).expect_err("export before the FD export");
        ensure!(
            err.is_call("cuMemPoolExportPointer", CuCode::INVALID_VALUE),
            "expected cuMemPoolExportPointer INVALID_VALUE, got {err}"
        );
        let _fd = d.mem_pool_export_fd(pool)?;
        d.mem_pool_export_pointer(ptr)?;
        alloc.free(stream)?;
        d.stream_synchronize(stream)?;
        owned_pool.close()?;
        Ok(())
    }
);

both_drivers!(
    /// The descriptors the driver exports for a pool and for a VMM allocation are
    /// close-on-exec: a process the parent starts afterwards (a worker, or anything else)
    /// must not inherit a copy it never learns of, which would keep the pool's or the
    /// allocation's memory from the device until that process exits.
    fn exported_pool_and_vmm_descriptors_are_close_on_exec(env) {
        use nix::fcntl::{FcntlArg, FdFlag, fcntl};
        let d = &*env.driver;
        let cloexec = |fd: &std::os::fd::OwnedFd| -> Result<bool> {
            let flags = FdFlag::from_bits_truncate(fcntl(fd, FcntlArg::F_GETFD)?);
            Ok(flags.contains(FdFlag::FD_CLOEXEC))
        };
        let owned_pool = OwnedPool::create(d, env.device, PoolSharing::PosixFd)?;
        let fd = d.mem_pool_export_fd(owned_pool.handle())?;
        ensure!(cloexec(&fd)?, "the pool's exported descriptor is inherited by children");
        drop(fd);
        owned_pool.close()?;
        let granularity = d.vmm_granularity(env.device, Granularity::Minimum)?;
        let vmm = poolipc::advanced::driver::VmmAllocation::create(d, env.device, granularity)?;
        let fd = d.vmm_export_fd(vmm.handle())?;
        ensure!(cloexec(&fd)?, "a VMM allocation's exported descriptor is inherited by children");
        drop(fd);
        vmm.close()?;
        Ok(())
    }
);

/// The child imports `bytes` from the parent, reads the parent's pattern at both ends, writes
/// its own pattern in place at both ends; the parent sees the writes and its pattern between.
fn child_reads_and_writes_in_place(env: &Env, bytes: u64) -> Result<()> {
    let pool = install(env)?;
    let d = &*env.driver;
    let owned_stream = OwnedStream::new(d)?;
    let stream = owned_stream.handle();
    let owned_ready = OwnedEvent::new(d, true)?;
    let ready = owned_ready.handle();
    let ptr = pool.alloc(bytes, stream)?;
    fill_then_record(d, ptr, bytes, 0xA5A5_0001, stream, ready)?;
    let blob = pool.export(ptr)?;
    let mut child = spawn_child(env, std::os::fd::AsFd::as_fd(&*pool.fd()))?;
    let ev = child.call(&format!("open {}", hex(&d.ipc_get_event_handle(ready)?.0)))?;
    child.call(&format!("wait {}", ev[0]))?;
    let imported = child.call(&format!("import {}", hex(&blob.0)))?;
    let theirs = &imported[0];
    // The child reads the ends (the whole of a small allocation), then writes 4 KiB at each.
    let sample = MIB.min(bytes);
    let mut reads = vec![0, bytes - sample];
    reads.dedup();
    for offset in reads {
        let got = child.call(&format!("check {theirs} {offset} {sample} a5a50001"))?;
        ensure!(
            num(&got, 0)? == 0,
            "child read {} wrong words at {offset}",
            got[0]
        );
    }
    let writes = [0, bytes - 4096];
    for offset in writes {
        child.call(&format!("fill {theirs} {offset} {} 5a5a0002", 4096 / 4))?;
    }
    let done = child.call("record")?;
    let done = d.ipc_open_event_handle(&EventBlob(poolipc_tests::unhex(&done[0])?))?;
    child.call(&format!("free {theirs}"))?;
    d.stream_wait_event(stream, done)?;
    d.stream_synchronize(stream)?;
    for offset in writes {
        ensure!(
            bad_words(d, ptr, offset, 4096, 0x5A5A_0002)? == 0,
            "parent does not see the write at {offset}"
        );
    }
    let between = sample.min(bytes - 4096) - 4096;
    ensure!(
        bad_words(d, ptr, 4096, between as usize, 0xA5A5_0001)? == 0,
        "bytes beside the writes changed"
    );
    ensure!(child.finish()?.success(), "child failed");
    pool.free(ptr, stream)?;
    d.stream_synchronize(stream)?;
    Ok(())
}

both_drivers!(
    fn a_child_imports_1_mib_reads_the_pattern_and_writes_in_place(env) {
        child_reads_and_writes_in_place(env, MIB)
    }
);

both_drivers!(
    fn a_child_imports_4096_mib_reads_the_pattern_and_writes_in_place(env) {
        child_reads_and_writes_in_place(env, 4096 * MIB)
    }
);

both_drivers!(
    fn interprocess_events_gate_both_directions(env) {
        // 1 GiB memsets take long enough on the GPU that reading without the event wait would
        // race; on SimDriver a touch without the wait is a recorded violation.
        let bytes = GIB;
        let pool = install(env)?;
        let d = &*env.driver;
        let owned_stream = OwnedStream::new(d)?;
        let stream = owned_stream.handle();
        let owned_ready = OwnedEvent::new(d, true)?;
        let ready = owned_ready.handle();
        let ptr = pool.alloc(bytes, stream)?;
        // Parent → child: READY is recorded right after the fill, nothing is synchronized.
        fill_then_record(d, ptr, bytes, 0x1111_1111, stream, ready)?;
        let blob = pool.export(ptr)?;
        let mut child = spawn_child(env, std::os::fd::AsFd::as_fd(&*pool.fd()))?;
        let ev = child.call(&format!("open {}", hex(&d.ipc_get_event_handle(ready)?.0)))?;
        child.call(&format!("wait {}", ev[0]))?;
        let theirs = child.call(&format!("import {}", hex(&blob.0)))?[0].clone();
        let got = child.call(&format!("check {theirs} {} {MIB} 11111111", bytes - MIB))?;
        ensure!(num(&got, 0)? == 0, "the child read before READY: {} bad words", got[0]);
        // Child → parent: the child fills everything and records DONE without synchronizing.
        child.call(&format!("fill {theirs} 0 {} 22222222", bytes / 4))?;
        let done = child.call("record")?;
        let done = d.ipc_open_event_handle(&EventBlob(poolipc_tests::unhex(&done[0])?))?;
        d.stream_wait_event(stream, done)?;
        d.stream_synchronize(stream)?;
        ensure!(bad_words(d, ptr, bytes - MIB, MIB as usize, 0x2222_2222)? == 0, "the parent read before DONE");
        child.call(&format!("free {theirs}"))?;
        ensure!(child.finish()?.success(), "child failed");
        pool.free(ptr, stream)?;
        d.stream_synchronize(stream)?;
        Ok(())
    }
);

both_drivers!(
    /// The parent's pool keeps freed memory (release threshold UINT64_MAX), and an import of
    /// recycled memory that is still mapped in the worker costs microseconds. Measured on the
    /// H200: a synchronize in the worker after it freed an import unmaps it (the imported pool
    /// has the default threshold, and driver 580 refuses to change an imported pool's
    /// attributes), so the next import maps it again at the first-import cost. Rounds 0-2 and
    /// 6-7 show that, rounds 3-5 the fast path.
    fn a_recycled_allocation_stays_reserved_and_imports_far_faster_than_new_memory(env) {
        let bytes = 4096 * MIB;
        let pool = install(env)?;
        let d = &*env.driver;
        let owned_stream = OwnedStream::new(d)?;
        let stream = owned_stream.handle();
        let mut child = spawn_child(env, std::os::fd::AsFd::as_fd(&*pool.fd()))?;
        let attached = child.call("pool")?;
        println!("{:?}: worker's imported pool: {}", env.kind(), attached.join(" "));
        // Rounds 0-2: the worker frees each import and synchronizes its stream; rounds 3-5:
        // it frees without synchronizing; rounds 6-7: it frees, then synchronizes separately.
        let mut import_micros = Vec::new();
        for round in 0..8u32 {
            let ptr = pool.alloc(bytes, stream)?;
            d.memset_d32_async(ptr, 0x3333_0000 + round, bytes / 4, stream)?;
            d.stream_synchronize(stream)?;
            let blob = pool.export(ptr)?;
            let got = child.call(&format!("import {}", hex(&blob.0)))?;
            import_micros.push(got[1].parse::<f64>()?);
            match round {
                0..=2 => child.call(&format!("free {}", got[0]))?,
                3..=5 => child.call(&format!("free_nosync {}", got[0]))?,
                _ => {
                    child.call(&format!("free_nosync {}", got[0]))?;
                    child.call("sync")?
                }
            };
            pool.free(ptr, stream)?;
            d.stream_synchronize(stream)?;
            let stats = pool.stats()?;
            ensure!(
                stats.reserved_current >= bytes,
                "the pool gave memory back at a synchronize (release threshold not in force): {stats}"
            );
            println!("{:?}: round {round}: {:#x} imported in {:.1} µs", env.kind(), ptr.0, import_micros[round as usize]);
        }
        ensure!(child.finish()?.success(), "child failed");
        let first = import_micros[0];
        // Memory the worker freed without a synchronize since: still mapped in the worker.
        let recycled = import_micros[4].min(import_micros[5]);
        println!(
            "{:?}: 4096 MiB import: first {first:.1} µs, recycled {recycled:.1} µs, ratio {:.0}×; \
             after a worker-side synchronize: {:.1} µs",
            env.kind(),
            first / recycled,
            import_micros[7]
        );
        if env.kind() == DriverKind::Cuda {
            ensure!(
                first >= 50.0 * recycled,
                "recycled import not 50× faster: first {first} µs, recycled {recycled} µs"
            );
        }
        Ok(())
    }
);

both_drivers!(
    fn a_pushed_device_is_current_until_popped_and_the_threads_context_before_comes_back(env) {
        // What a Python worker's call does on the caller's thread: push the worker's device,
        // work, pop. On a fresh thread (no context on CUDA) the work runs, and after the pop
        // the thread has no context again: a caller's torch keeps its own.
        let d = Arc::clone(&env.driver);
        let (device, kind) = (env.device, env.kind());
        std::thread::spawn(move || -> Result<()> {
            if kind == DriverKind::Cuda {
                ensure!(d.mem_get_info().is_err(), "a fresh thread already has a context");
            }
            d.push_device(device)?;
            let (free, total) = d.mem_get_info()?;
            ensure!(total > 0 && free <= total, "mem_get_info: {free} of {total}");
            let owned_stream = OwnedStream::new(d.clone())?;
            let stream = owned_stream.handle();
            d.stream_synchronize(stream)?;
            d.pop_device()?;
            if kind == DriverKind::Cuda {
                ensure!(d.mem_get_info().is_err(), "a context is still current after the pop");
                // Pushed twice, popped once: the first push's context is current still.
                d.push_device(device)?;
                d.push_device(device)?;
                d.pop_device()?;
                ensure!(d.mem_get_info().is_ok(), "the pop took both pushes");
                d.pop_device()?;
            }
            Ok(())
        })
        .join()
        .map_err(|_| anyhow::anyhow!("the thread panicked"))??;
        Ok(())
    }
);
