//! The same scenarios on CudaDriver and on SimDriver must end the same way: success, the same
//! typed error, or the same crash. Each expectation here is what the H200 (driver 580) did;
//! SimDriver is made to match it.

use std::sync::Arc;

use anyhow::{Result, ensure};
use poolipc::advanced::driver::sim::ViolationKind;
use poolipc::advanced::driver::{CuCode, Driver, DriverError, OwnedStream, PoolSharing};
use poolipc::advanced::pool::SharedPool;
use poolipc_tests::{Env, both_drivers, hex, spawn_child};

const MIB: u64 = 1 << 20;

fn install(env: &Env) -> Result<SharedPool<dyn Driver>> {
    Ok(SharedPool::install(Arc::clone(&env.driver), env.device)?)
}

fn expect_code(
    r: Result<impl std::fmt::Debug, DriverError>,
    call: &str,
    code: CuCode,
) -> Result<()> {
    match r {
        Err(e) if e.is_call(call, code) => Ok(()),
        other => anyhow::bail!("expected {call} to fail with {code}, got {other:?}"),
    }
}

both_drivers!(
    fn an_imported_pool_starts_read_write_and_refuses_attributes(env) {
        let pool = install(env)?;
        let mut child = spawn_child(env, std::os::fd::AsFd::as_fd(&*pool.fd()))?;
        let got = child.call("pool")?.join(" ");
        ensure!(got.contains("access_before=ReadWrite"), "worker's imported pool: {got}");
        ensure!(got.contains("threshold_before=None"), "worker's imported pool: {got}");
        let err = child.call_err("set_threshold")?;
        ensure!(err.contains("cuMemPoolSetAttribute failed: CUDA_ERROR_INVALID_VALUE"), "{err}");
        ensure!(child.finish()?.success(), "child failed");
        Ok(())
    }
);

both_drivers!(
    fn importing_the_same_export_twice_gives_the_same_address(env) {
        let pool = install(env)?;
        let d = &*env.driver;
        let owned_stream = OwnedStream::new(d)?;
        let stream = owned_stream.handle();
        let ptr = pool.alloc(MIB, stream)?;
        d.stream_synchronize(stream)?;
        let blob = hex(&pool.export(ptr)?.0);
        let mut child = spawn_child(env, std::os::fd::AsFd::as_fd(&*pool.fd()))?;
        let a = child.call(&format!("import {blob}"))?;
        let b = child.call(&format!("import {blob}"))?;
        ensure!(a[0] == b[0], "two imports of one export: {} and {}", a[0], b[0]);
        child.call(&format!("free {}", a[0]))?;
        ensure!(child.finish()?.success(), "child failed");
        pool.free(ptr, stream)?;
        d.stream_synchronize(stream)?;
        Ok(())
    }
);

both_drivers!(
    /// The pool still holds the memory (release threshold UINT64_MAX), and driver 580 maps
    /// the stale export without complaint: the contract, not the driver, must prevent it.
    fn an_export_of_freed_memory_the_pool_still_holds_imports_anyway(env) {
        let pool = install(env)?;
        let d = &*env.driver;
        let owned_stream = OwnedStream::new(d)?;
        let stream = owned_stream.handle();
        let ptr = pool.alloc(MIB, stream)?;
        d.stream_synchronize(stream)?;
        let blob = hex(&pool.export(ptr)?.0);
        pool.free(ptr, stream)?;
        d.stream_synchronize(stream)?;
        let mut child = spawn_child(env, std::os::fd::AsFd::as_fd(&*pool.fd()))?;
        let got = child.call(&format!("import {blob}"))?;
        child.call(&format!("free {}", got[0]))?;
        ensure!(child.finish()?.success(), "child failed");
        if let Some(sim) = &env.sim {
            let v = sim.violations();
            ensure!(
                v.len() == 1 && v[0].kind == ViolationKind::ImportOfFreed,
                "the simulation should record the stale import: {v:?}"
            );
            sim.clear_violations();
        }
        Ok(())
    }
);

both_drivers!(
    fn an_event_without_the_interprocess_flag_has_no_ipc_handle(env) {
        let d = &*env.driver;
        let ev = poolipc::advanced::driver::OwnedEvent::new(d, false)?;
        expect_code(ev.ipc_handle(), "cuIpcGetEventHandle", CuCode::INVALID_HANDLE)?;
        ev.close()?;
        Ok(())
    }
);

both_drivers!(
    fn a_pool_shared_by_nothing_cannot_export_its_fd(env) {
        let d = &*env.driver;
        let pool = poolipc::advanced::driver::OwnedPool::create(d, env.device, PoolSharing::None)?;
        let r = d.mem_pool_export_fd(pool.handle());
        ensure!(r.is_err(), "a pool with handleTypes NONE exported an FD");
        println!("{:?}: {}", env.kind(), r.err().map(|e| e.to_string()).unwrap_or_default());
        pool.close()?;
        Ok(())
    }
);

both_drivers!(
    fn the_range_of_an_address_inside_an_allocation_is_the_allocation(env) {
        let pool = install(env)?;
        let d = &*env.driver;
        let owned_stream = OwnedStream::new(d)?;
        let stream = owned_stream.handle();
        let ptr = pool.alloc(3 * MIB, stream)?;
        d.stream_synchronize(stream)?;
        let (base, len) = d.pointer_get_range(ptr.offset(MIB + 5))?;
        ensure!(base == ptr, "range base {base:?}, allocation {ptr:?}");
        ensure!(len == 3 * MIB, "range length {len}");
        ensure!(d.pointer_get_mempool(ptr.offset(MIB))? == pool.handle(), "interior pointer's pool");
        pool.free(ptr, stream)?;
        d.stream_synchronize(stream)?;
        Ok(())
    }
);

// `CU_POINTER_ATTRIBUTE_BUFFER_ID`, which the export cache relies on (docs/facts.md:
// 917 then 918 at the same address on the H200). Not here: `cuMemRetainAllocationHandle` on
// pool memory (INVALID_VALUE on the H200), because the `Driver` trait has no retain call.

both_drivers!(
    fn an_address_the_pool_hands_out_again_has_a_new_buffer_id(env) {
        let pool = install(env)?;
        let d = &*env.driver;
        let owned_stream = OwnedStream::new(d)?;
        let stream = owned_stream.handle();
        let a = pool.alloc(MIB, stream)?;
        d.stream_synchronize(stream)?;
        let first = d.pointer_get_buffer_id(a)?;
        pool.free(a, stream)?;
        d.stream_synchronize(stream)?;
        let b = pool.alloc(MIB, stream)?;
        d.stream_synchronize(stream)?;
        ensure!(a == b, "the pool did not hand {a:?} out again (got {b:?})");
        let second = d.pointer_get_buffer_id(b)?;
        ensure!(second != first, "buffer id {first} kept across free and reallocation");
        println!("{:?}: buffer ids {first} then {second} at {a:?}", env.kind());
        pool.free(b, stream)?;
        d.stream_synchronize(stream)?;
        Ok(())
    }
);

both_drivers!(
    fn a_live_allocation_gives_the_same_buffer_id_every_time(env) {
        let pool = install(env)?;
        let d = &*env.driver;
        let owned_stream = OwnedStream::new(d)?;
        let stream = owned_stream.handle();
        let a = pool.alloc(MIB, stream)?;
        d.stream_synchronize(stream)?;
        let first = d.pointer_get_buffer_id(a)?;
        let again = d.pointer_get_buffer_id(a)?;
        ensure!(first == again, "two queries of one live allocation: {first} and {again}");
        pool.free(a, stream)?;
        d.stream_synchronize(stream)?;
        Ok(())
    }
);

both_drivers!(
    fn an_interior_pointer_has_its_allocations_buffer_id(env) {
        let pool = install(env)?;
        let d = &*env.driver;
        let owned_stream = OwnedStream::new(d)?;
        let stream = owned_stream.handle();
        let a = pool.alloc(3 * MIB, stream)?;
        d.stream_synchronize(stream)?;
        let base = d.pointer_get_buffer_id(a)?;
        let inside = d.pointer_get_buffer_id(a.offset(MIB + 5))?;
        ensure!(base == inside, "base {base}, interior pointer {inside}");
        pool.free(a, stream)?;
        d.stream_synchronize(stream)?;
        Ok(())
    }
);
