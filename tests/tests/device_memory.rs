//! Any device memory of the parent's device crosses on the device: a tensor that is
//! not memory of the parent's shared pool — plain `cuMemAlloc` memory, or a VMM allocation
//! made with `cuMemCreate` + `cuMemMap` as ComfyUI makes its model weights — is copied
//! device-to-device into the parent's arena (the arena-copy rung) rather than staged through
//! host memory, and a write the worker makes into it comes back to the parent as it does for
//! pool memory on that rung. A VMM allocation made with the POSIX FD handle type is lent by
//! its handle instead (the VMM-handle rung): no copy, the worker's write lands in the
//! parent's memory itself, and the worker keeps its mapping, so lending it again sends
//! nothing but the job. A pointer into nothing is refused with an error that says so, and
//! the parent goes on serving.

use std::sync::Arc;

use anyhow::{Context, Result, bail, ensure};
use poolipc::advanced::RawDriver;
use poolipc::advanced::driver::{
    Access, DeviceAllocation, Driver, Granularity, OwnedStream, VmmAllocation, VmmMapping,
    VmmReservation,
};
use poolipc::{DevicePtr, Error, Parent, ParentOptions, Rung};
use poolipc_tests::echo;
use poolipc_tests::echo_jobs::{bytes_input, check_exact, filled, settle};
use poolipc_tests::{Env, both_drivers, worker_command};

const MIB: u64 = 1 << 20;
/// Not a multiple of anything: every byte of the copy, and of the copy back, counts.
const BYTES: u64 = MIB + 3;
/// Where in its allocation the tensor starts: the rung must honour the offset.
const OFFSET: u64 = 4096;

/// The kinds of device memory outside the shared pool that the tests lend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// `cuMemAlloc`.
    MemAlloc,
    /// `cuMemCreate` without a shareable handle type, mapped with `cuMemMap`.
    VmmUnshared,
    /// `cuMemCreate` with the POSIX FD handle type, mapped with `cuMemMap`.
    VmmShared,
}

/// A device allocation of one [`Kind`], freed by [`Foreign::free`].
struct Foreign {
    driver: Arc<dyn Driver>,
    base: DevicePtr,
    len: u64,
    owner: Owner,
}

/// What owns a [`Foreign`]'s memory.
enum Owner {
    Plain(DeviceAllocation),
    /// Unmapped (and its range freed) before the handle is released: the fields' order.
    Vmm {
        mapping: VmmMapping,
        handle: VmmAllocation,
    },
}

impl Foreign {
    fn new(env: &Env, kind: Kind, bytes: u64) -> Result<Foreign> {
        let d = Arc::clone(&env.driver);
        match kind {
            Kind::MemAlloc => {
                let mem = DeviceAllocation::new(Arc::clone(&d), bytes)?;
                Ok(Foreign {
                    driver: d,
                    base: mem.ptr(),
                    len: bytes,
                    owner: Owner::Plain(mem),
                })
            }
            Kind::VmmUnshared | Kind::VmmShared => {
                let g = d.vmm_granularity(env.device, Granularity::Minimum)?;
                let len = bytes.next_multiple_of(g);
                let handle = if kind == Kind::VmmShared {
                    VmmAllocation::create(Arc::clone(&d), env.device, len)?
                } else {
                    VmmAllocation::create_unshared(Arc::clone(&d), env.device, len)?
                };
                let range = VmmReservation::reserve(Arc::clone(&d), len, 0)?;
                let mapping = VmmMapping::map(range, handle.handle())?;
                mapping.set_access(env.device, Access::ReadWrite)?;
                Ok(Foreign {
                    driver: d,
                    base: mapping.ptr(),
                    len,
                    owner: Owner::Vmm { mapping, handle },
                })
            }
        }
    }

    fn free(self) -> Result<()> {
        self.driver.ctx_synchronize()?;
        match self.owner {
            Owner::Plain(mem) => mem.close()?,
            Owner::Vmm { mapping, handle } => {
                mapping.close()?;
                handle.close()?;
            }
        }
        Ok(())
    }
}

fn parent(env: &Env) -> Result<Parent> {
    let options = ParentOptions {
        device: env.device,
        canary: false,
        ..ParentOptions::default()
    };
    Ok(Parent::new(Arc::clone(&env.driver), options)?)
}

/// The tensor the worker wrote its marker over (first 4 KiB) or not, filled with `pattern`.
fn expected(pattern: u32, written: bool) -> Result<Vec<u8>> {
    let mut want: Vec<u8> = pattern
        .to_le_bytes()
        .iter()
        .copied()
        .cycle()
        .take(usize::try_from(BYTES)?)
        .collect();
    if written {
        for w in want[..4096].chunks_exact_mut(4) {
            w.copy_from_slice(&echo::marker(0).to_le_bytes());
        }
    }
    Ok(want)
}

fn check_tensor(p: &Parent, src: DevicePtr, pattern: u32, written: bool) -> Result<()> {
    let mut got = vec![0u8; usize::try_from(BYTES)?];
    p.driver().memcpy_dtoh(&mut got, src)?;
    let want = expected(pattern, written)?;
    if let Some(at) = got.iter().zip(&want).position(|(g, w)| g != w) {
        bail!(
            "the parent's tensor at byte {at}: {:#04x}, expected {:#04x} (written: {written})",
            got[at],
            want[at]
        );
    }
    Ok(())
}

/// Lends a `kind` tensor (at an offset in its allocation) to an echo worker: it takes the
/// arena copy, says why, and every byte arrives.
fn crosses_by_arena_copy(env: &Env, kind: Kind) -> Result<()> {
    let p = parent(env)?;
    let owned_stream = OwnedStream::new(p.driver().clone())?;
    let stream = owned_stream.handle();
    let w = p.spawn_worker(worker_command(env, None)?)?;
    let mem = Foreign::new(env, kind, OFFSET + BYTES)?;
    let src = mem.base.offset(OFFSET);
    let pattern = 0x5EED_0000 | kind as u32;
    echo::fill_pattern(&**p.driver(), src, BYTES, pattern, stream)?;
    let out = p.run_job(w, &[bytes_input(src, BYTES)], stream)?;
    p.driver().stream_synchronize(stream)?;
    ensure!(
        out.input_rungs == [Rung::ArenaCopy],
        "{kind:?}: {:?}",
        out.input_rungs
    );
    let reason = out.input_reasons[0]
        .as_deref()
        .context("no reason for a non-pointer rung")?;
    println!("{kind:?}: {reason}");
    ensure!(
        reason.contains("it is not memory of this parent's pools")
            && reason.contains(": arena copy ("),
        "{reason}"
    );
    check_exact(&p, &out, 0, BYTES, pattern)?;
    ensure!(p.stats().arena_copied_inputs == 1, "{:?}", p.stats());
    ensure!(p.stats().host_staged_tensors == 0, "{:?}", p.stats());
    for r in out.results {
        if !r.is_arena() {
            p.pool().free(r.ptr, stream)?;
        }
    }
    ensure!(settle(&p, stream)? == 0, "the copy's block is still out");
    mem.free()?;
    p.stop_worker(w)?;
    Ok(())
}

/// Lends a `kind` tensor writable to a worker that writes its inputs in place: the write
/// comes back to the parent's tensor (the block copied back after the wait on DONE).
fn a_write_comes_back(env: &Env, kind: Kind) -> Result<()> {
    let p = parent(env)?;
    let owned_stream = OwnedStream::new(p.driver().clone())?;
    let stream = owned_stream.handle();
    let mut cmd = worker_command(env, None)?;
    cmd.env("POOLIPC_TEST_WRITE_INPUTS", "1");
    let w = p.spawn_worker(cmd)?;
    let mem = Foreign::new(env, kind, OFFSET + BYTES)?;
    let src = mem.base.offset(OFFSET);
    let pattern = 0x0BAD_F00D;
    echo::fill_pattern(&**p.driver(), src, BYTES, pattern, stream)?;
    let out = p.run_job(w, &[bytes_input(src, BYTES)], stream)?;
    p.driver().stream_synchronize(stream)?;
    ensure!(
        out.input_rungs == [Rung::ArenaCopy],
        "{kind:?}: {:?}",
        out.input_rungs
    );
    check_tensor(&p, src, pattern, true)?;
    ensure!(p.stats().inputs_copied_back == 1, "{:?}", p.stats());
    drop(out);
    ensure!(settle(&p, stream)? == 0, "the copy's block is still out");
    mem.free()?;
    p.stop_worker(w)?;
    Ok(())
}

both_drivers!(
    fn a_cu_mem_alloc_tensor_crosses_by_arena_copy_byte_for_byte(env) {
        crosses_by_arena_copy(env, Kind::MemAlloc)
    }
);

both_drivers!(
    fn a_write_into_a_lent_cu_mem_alloc_tensor_comes_back_to_the_parent(env) {
        a_write_comes_back(env, Kind::MemAlloc)
    }
);

both_drivers!(
    fn a_vmm_tensor_without_a_posix_fd_handle_crosses_by_arena_copy_byte_for_byte(env) {
        crosses_by_arena_copy(env, Kind::VmmUnshared)
    }
);

both_drivers!(
    fn a_write_into_a_lent_unshared_vmm_tensor_comes_back_to_the_parent(env) {
        a_write_comes_back(env, Kind::VmmUnshared)
    }
);

both_drivers!(
    fn with_the_arena_copy_off_a_cu_mem_alloc_tensor_takes_host_staging_and_says_why(env) {
        // The mutation check of the rule: the same tensor, the rung switched off, lands on
        // the rung below and the tests above would see it.
        let options = ParentOptions {
            device: env.device,
            canary: false,
            arena_copy: false,
            ..ParentOptions::default()
        };
        let p = Parent::new(Arc::clone(&env.driver), options)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let w = p.spawn_worker(worker_command(env, None)?)?;
        let mem = Foreign::new(env, Kind::MemAlloc, BYTES)?;
        echo::fill_pattern(&**p.driver(), mem.base, BYTES, 0x7777_1111, stream)?;
        let out = p.run_job(w, &[bytes_input(mem.base, BYTES)], stream)?;
        p.driver().stream_synchronize(stream)?;
        ensure!(out.input_rungs == [Rung::HostStaging], "{:?}", out.input_rungs);
        let reason = out.input_reasons[0].as_deref().context("no reason")?;
        ensure!(reason.contains("arena copy is off"), "{reason}");
        check_exact(&p, &out, 0, BYTES, 0x7777_1111)?;
        for r in out.results {
            p.pool().free(r.ptr, stream)?;
        }
        mem.free()?;
        p.stop_worker(w)?;
        Ok(())
    }
);

both_drivers!(
    fn a_freed_cu_mem_alloc_pointer_is_refused_clearly_and_the_parent_goes_on(env) {
        let p = parent(env)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let w = p.spawn_worker(worker_command(env, None)?)?;
        let mem = Foreign::new(env, Kind::MemAlloc, BYTES)?;
        let gone = mem.base;
        mem.free()?;
        match p.run_job(w, &[bytes_input(gone, BYTES)], stream) {
            Err(Error::InvalidTensor(why)) => {
                println!("{:?}: {why}", env.kind());
                ensure!(why.contains("is not device memory this process can see"), "{why}");
            }
            Err(other) => bail!("an unexpected error: {other}"),
            Ok(out) => bail!("a freed pointer was lent: {:?}", out.input_rungs),
        }
        // The same worker takes the next job as if nothing happened.
        let ok = filled(&p, MIB, 0x1234_5678, stream)?;
        let out = p.run_job(w, &[bytes_input(ok, MIB)], stream)?;
        p.driver().stream_synchronize(stream)?;
        check_exact(&p, &out, 0, MIB, 0x1234_5678)?;
        for r in out.results {
            p.pool().free(r.ptr, stream)?;
        }
        p.pool().free(ok, stream)?;
        p.driver().stream_synchronize(stream)?;
        p.stop_worker(w)?;
        Ok(())
    }
);

/// A parent whose VMM-handle rung is on (the default) or off.
fn parent_with_vmm_handles(env: &Env, on: bool) -> Result<Parent> {
    let options = ParentOptions {
        device: env.device,
        canary: false,
        vmm_handles: on,
        ..ParentOptions::default()
    };
    Ok(Parent::new(Arc::clone(&env.driver), options)?)
}

both_drivers!(
    fn a_vmm_tensor_with_a_posix_fd_handle_is_lent_by_handle_and_lent_again_without_a_share(env) {
        let p = parent(env)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let w = p.spawn_worker(worker_command(env, None)?)?;
        let mem = Foreign::new(env, Kind::VmmShared, OFFSET + BYTES)?;
        let src = mem.base.offset(OFFSET);
        for (round, pattern) in [0x1111_2222u32, 0x3333_4444, 0x5555_6666].into_iter().enumerate() {
            echo::fill_pattern(&**p.driver(), src, BYTES, pattern, stream)?;
            let out = p.run_job(w, &[bytes_input(src, BYTES)], stream)?;
            p.driver().stream_synchronize(stream)?;
            ensure!(out.input_rungs == [Rung::VmmHandle], "round {round}: {:?}", out.input_rungs);
            let reason = out.input_reasons[0].as_deref().context("no reason")?;
            println!("round {round}: {reason}");
            let how = if round == 0 { "handle sent" } else { "mapped by the worker already" };
            ensure!(reason.contains(&format!(": vmm handle ({how})")), "round {round}: {reason}");
            // Every byte the worker read is this round's: it reads the parent's memory
            // through its mapping, after READY.
            check_exact(&p, &out, 0, BYTES, pattern)?;
            for r in out.results {
                p.pool().free(r.ptr, stream)?;
            }
        }
        let stats = p.stats();
        ensure!(stats.vmm_handle_tensors == 3, "{stats:?}");
        ensure!(stats.vmm_handles_shared == 1, "the handle went more than once: {stats:?}");
        ensure!(stats.arena_copied_inputs == 0 && stats.host_staged_tensors == 0, "{stats:?}");
        p.driver().stream_synchronize(stream)?;
        p.stop_worker(w)?;
        mem.free()?;
        Ok(())
    }
);

both_drivers!(
    fn a_write_into_a_vmm_tensor_lent_by_handle_lands_in_the_parent_memory_itself(env) {
        let p = parent(env)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let mut cmd = worker_command(env, None)?;
        cmd.env("POOLIPC_TEST_WRITE_INPUTS", "1");
        let w = p.spawn_worker(cmd)?;
        let mem = Foreign::new(env, Kind::VmmShared, OFFSET + BYTES)?;
        let src = mem.base.offset(OFFSET);
        let pattern = 0x0BAD_F00D;
        echo::fill_pattern(&**p.driver(), src, BYTES, pattern, stream)?;
        let out = p.run_job(w, &[bytes_input(src, BYTES)], stream)?;
        p.driver().stream_synchronize(stream)?;
        ensure!(out.input_rungs == [Rung::VmmHandle], "{:?}", out.input_rungs);
        check_tensor(&p, src, pattern, true)?;
        // Nothing was copied: the write is in the parent's memory.
        ensure!(p.stats().inputs_copied_back == 0, "{:?}", p.stats());
        drop(out);
        p.stop_worker(w)?;
        mem.free()?;
        Ok(())
    }
);

both_drivers!(
    fn with_vmm_handles_off_a_shareable_vmm_tensor_takes_the_arena_copy_and_says_why(env) {
        // The mutation check of the handle rung: off, the same tensor is copied.
        let p = parent_with_vmm_handles(env, false)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let w = p.spawn_worker(worker_command(env, None)?)?;
        let mem = Foreign::new(env, Kind::VmmShared, BYTES)?;
        echo::fill_pattern(&**p.driver(), mem.base, BYTES, 0x2468_1357, stream)?;
        let out = p.run_job(w, &[bytes_input(mem.base, BYTES)], stream)?;
        p.driver().stream_synchronize(stream)?;
        ensure!(out.input_rungs == [Rung::ArenaCopy], "{:?}", out.input_rungs);
        let reason = out.input_reasons[0].as_deref().context("no reason")?;
        ensure!(reason.contains("lending by VMM handle is off"), "{reason}");
        check_exact(&p, &out, 0, BYTES, 0x2468_1357)?;
        ensure!(p.stats().vmm_handles_shared == 0, "{:?}", p.stats());
        for r in out.results {
            p.pool().free(r.ptr, stream)?;
        }
        ensure!(settle(&p, stream)? == 0, "the copy's block is still out");
        p.stop_worker(w)?;
        mem.free()?;
        Ok(())
    }
);

both_drivers!(
    fn an_unshareable_vmm_tensor_says_why_it_was_not_lent_by_handle(env) {
        let p = parent(env)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let w = p.spawn_worker(worker_command(env, None)?)?;
        let mem = Foreign::new(env, Kind::VmmUnshared, BYTES)?;
        echo::fill_pattern(&**p.driver(), mem.base, BYTES, 0x1357_2468, stream)?;
        let out = p.run_job(w, &[bytes_input(mem.base, BYTES)], stream)?;
        p.driver().stream_synchronize(stream)?;
        ensure!(out.input_rungs == [Rung::ArenaCopy], "{:?}", out.input_rungs);
        let reason = out.input_reasons[0].as_deref().context("no reason")?;
        println!("{:?}: {reason}", env.kind());
        ensure!(reason.contains("without the POSIX FD handle type"), "{reason}");
        for r in out.results {
            p.pool().free(r.ptr, stream)?;
        }
        ensure!(settle(&p, stream)? == 0, "the copy's block is still out");
        p.stop_worker(w)?;
        mem.free()?;
        Ok(())
    }
);

both_drivers!(
    fn a_write_into_a_vmm_tensor_lent_read_only_by_handle_fails_the_job_and_the_memory_is_as_lent(env) {
        // Lent by handle there is no copy to protect the parent's memory: the worker views
        // a read-only input through a read-only mapping, so its write faults and the job
        // fails instead of changing the caller's tensor (model weights, say).
        let p = parent(env)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let mut cmd = worker_command(env, None)?;
        cmd.env("POOLIPC_TEST_WRITE_INPUTS", "1");
        let w = p.spawn_worker(cmd)?;
        let mem = Foreign::new(env, Kind::VmmShared, BYTES)?;
        let pattern = 0x600D_CAFE;
        echo::fill_pattern(&**p.driver(), mem.base, BYTES, pattern, stream)?;
        let input = bytes_input(mem.base, BYTES).read_only();
        match p.run_job(w, &[input], stream) {
            Err(e @ (Error::Worker { .. } | Error::JobFailed { .. })) => println!("{:?}: {e}", env.kind()),
            // The simulation's race checker names the write as well.
            Err(Error::SimViolation { during: Some(e), .. })
                if matches!(*e, Error::Worker { .. } | Error::JobFailed { .. }) =>
            {
                println!("{:?}: {e}", env.kind());
            }
            Ok(out) => bail!("the write into a read-only VMM tensor went through silently: {:?}", out.input_rungs),
            Err(other) => bail!("an unexpected error: {other}"),
        }
        p.driver().stream_synchronize(stream)?;
        check_tensor(&p, mem.base, pattern, false)?;
        ensure!(p.stats().vmm_handle_tensors == 1, "{:?}", p.stats());
        if let Some(sim) = &env.sim {
            // The simulation refused the write as the hardware does, and logged it: expected.
            let v = sim.violations();
            ensure!(
                !v.is_empty() && v.iter().all(|v| format!("{:?}", v.kind) == "NoAccess"),
                "the refused write should be logged as NoAccess, and only it: {v:#?}"
            );
            sim.clear_violations();
        }
        let _ = p.stop_worker(w);
        mem.free()?;
        Ok(())
    }
);

both_drivers!(
    fn a_vmm_allocation_lent_by_handle_and_freed_goes_back_to_the_device_on_empty_cache(env) {
        // The worker caches its mapping; a mapping keeps the memory behind it alive after the
        // parent freed the allocation, until `empty_cache` has the worker drop it.
        let p = parent(env)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let w = p.spawn_worker(worker_command(env, None)?)?;
        let bytes = 256 * MIB;
        let before = {
            p.driver().ctx_synchronize()?;
            p.driver().mem_get_info()?.0
        };
        let mem = Foreign::new(env, Kind::VmmShared, bytes)?;
        let len = mem.len;
        echo::fill_pattern(&**p.driver(), mem.base, bytes, 0x7777_0001, stream)?;
        let out = p.run_job(w, &[bytes_input(mem.base, bytes)], stream)?;
        p.driver().stream_synchronize(stream)?;
        ensure!(out.input_rungs == [Rung::VmmHandle], "{:?}", out.input_rungs);
        for r in out.results {
            p.pool().free(r.ptr, stream)?;
        }
        p.driver().stream_synchronize(stream)?;
        mem.free()?;
        let free = |p: &Parent| -> Result<u64> {
            p.driver().ctx_synchronize()?;
            Ok(p.driver().mem_get_info()?.0)
        };
        let held = free(&p)?;
        let report = p.empty_cache()?;
        println!("empty_cache: {report:?}");
        ensure!(report.vmm_workers == 1 && report.workers_not_answered == 0, "{report:?}");
        let after = free(&p)?;
        println!(
            "free VRAM: {} MiB before the allocation, {} MiB with it freed but mapped by the \
             worker, {} MiB after empty_cache",
            before / MIB,
            held / MIB,
            after / MIB
        );
        // The pool's results were trimmed too; the VMM allocation's bytes must be back (to
        // within a small slack: the first driver calls' own memory on hardware).
        ensure!(
            after + 32 * MIB >= before,
            "{} MiB of the {} MiB VMM allocation still held",
            before.saturating_sub(after) / MIB,
            len / MIB
        );
        // The worker still serves a VMM tensor (shared again: it dropped the old mapping).
        let mem = Foreign::new(env, Kind::VmmShared, bytes)?;
        echo::fill_pattern(&**p.driver(), mem.base, bytes, 0x7777_0002, stream)?;
        let out = p.run_job(w, &[bytes_input(mem.base, bytes)], stream)?;
        p.driver().stream_synchronize(stream)?;
        ensure!(out.input_rungs == [Rung::VmmHandle], "{:?}", out.input_rungs);
        check_exact(&p, &out, 0, bytes, 0x7777_0002)?;
        for r in out.results {
            p.pool().free(r.ptr, stream)?;
        }
        p.driver().stream_synchronize(stream)?;
        p.stop_worker(w)?;
        mem.free()?;
        Ok(())
    }
);
