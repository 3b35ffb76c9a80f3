//! Several simulated devices: a worker whose `CUDA_VISIBLE_DEVICES` differs from the parent's
//! finds the parent's device by UUID, and one that cannot is refused with a reason on both
//! sides while the parent keeps serving; a worker on another device than the pool's takes
//! tensors by pool pointer through peer access, or by host staging where the devices cannot
//! reach each other; a parent with a pool per device lends from either and allocates results
//! on either, by pointer where the worker can use that pool and by host staging where not.
//! SimDriver only: the hardware half needs a machine with two GPUs.

use std::sync::Arc;

use anyhow::{Result, ensure};
use poolipc::{DType, Error, Input, Parent, ParentOptions, Rung, TensorDesc, echo};
use poolipc_driver::sim::{SimConfig, SimDriver, VISIBLE_ENV};
use poolipc_driver::{DevicePtr, Driver, DriverKind, StreamHandle};
use poolipc_tests::{Env, worker_command};
use poolipc_transport::{ErrorCode, HandshakeError};

const MIB: u64 = 1 << 20;

/// A machine of three simulated devices, the parent on device 2.
fn three_devices() -> Result<(Env, Parent)> {
    machine(
        SimConfig {
            devices: 3,
            ..SimConfig::default()
        },
        2,
    )
}

/// A simulated machine, the parent's pool on `device`.
fn machine(config: SimConfig, device: u32) -> Result<(Env, Parent)> {
    let sim = Arc::new(SimDriver::new(config)?);
    sim.use_device(device)?;
    let env = Env {
        driver: sim.clone(),
        sim: Some(sim),
        device,
    };
    let parent = Parent::new(
        Arc::clone(&env.driver),
        ParentOptions {
            device,
            ..ParentOptions::default()
        },
    )?;
    Ok((env, parent))
}

/// The echo worker, seeing `visible`, on `device` (`parent` or an ordinal).
fn worker(env: &Env, visible: &str, device: &str) -> Result<std::process::Command> {
    let mut cmd = worker_command(env, None)?;
    cmd.env(VISIBLE_ENV, visible)
        .env("POOLIPC_TEST_DEVICE", device);
    Ok(cmd)
}

/// One job through `worker`: 1 MiB lent, the echoed result checked.
fn one_job(p: &mut Parent, worker: poolipc::WorkerId) -> Result<()> {
    one_job_by(p, worker).map(|_| ())
}

/// [`one_job`], returning the rungs the input and the result took.
fn one_job_by(p: &mut Parent, worker: poolipc::WorkerId) -> Result<(Rung, Rung)> {
    let d = Arc::clone(p.driver());
    let stream = d.stream_create()?;
    let input = p.pool().alloc(MIB, stream)?;
    echo::fill_pattern(&*d, input, MIB, 0x600D_D00D, stream)?;
    let out = p.run_job(
        worker,
        &[Input {
            ptr: input,
            desc: TensorDesc::contiguous(DType::U8, &[MIB]),
        }],
        stream,
    )?;
    d.stream_synchronize(stream)?;
    let mut got = [0u8; 8];
    d.memcpy_dtoh(&mut got, out.results[0].ptr)?;
    ensure!(
        got[4..] == 0x600D_D00Du32.to_le_bytes(),
        "result content {got:x?}"
    );
    p.pool().free(out.results[0].ptr, stream)?;
    p.pool().free(input, stream)?;
    d.stream_synchronize(stream)?;
    d.stream_destroy(stream)?;
    Ok((out.input_rungs[0], out.results[0].rung))
}

fn refusal(result: Result<poolipc::WorkerId, Error>) -> Result<String> {
    match result {
        Err(Error::Handshake(HandshakeError::Refused { code, message }))
            if code == ErrorCode::DEVICE_MISMATCH =>
        {
            Ok(message)
        }
        other => anyhow::bail!("expected a device refusal, got {other:?}"),
    }
}

#[test]
fn a_worker_that_sees_the_parents_device_under_another_ordinal_finds_it_by_uuid() -> Result<()> {
    let (env, mut p) = three_devices()?;
    ensure!(env.kind() == DriverKind::Sim);
    // Machine device 2 is the worker's ordinal 1.
    let w = p.spawn_worker(worker(&env, "0,2", "parent")?)?;
    let parent_uuid = env.driver.device_info(2)?.uuid;
    ensure!(
        p.worker(w).map(|i| i.identity.device.0) == Some(parent_uuid.0),
        "the worker's identity names the parent's device"
    );
    one_job(&mut p, w)?;
    one_job(&mut p, w)?;
    p.stop_worker(w)?;
    env.assert_no_violations();
    Ok(())
}

#[test]
fn a_worker_given_the_parents_ordinal_under_another_visibility_is_refused() -> Result<()> {
    let (env, mut p) = three_devices()?;
    // Ordinal 2 does not exist for it; ordinal 1 is machine device 0: a mismatch, by UUID.
    let message = refusal(p.spawn_worker(worker(&env, "2,0", "1")?))?;
    ensure!(message.contains("device mismatch"), "{message}");
    // The parent goes on: the next worker, on the right device, works.
    let w = p.spawn_worker(worker(&env, "2,0", "0")?)?;
    one_job(&mut p, w)?;
    p.stop_worker(w)?;
    env.assert_no_violations();
    Ok(())
}

#[test]
fn a_worker_that_does_not_see_the_parents_device_says_what_it_sees() -> Result<()> {
    let (env, mut p) = three_devices()?;
    let message = refusal(p.spawn_worker(worker(&env, "1,0", "parent")?))?;
    eprintln!("refused: {message}");
    let visible_uuid = env.driver.device_info(1)?.uuid.to_string();
    ensure!(
        message.contains("sees 2") && message.contains(&visible_uuid),
        "{message}"
    );
    let message = refusal(p.spawn_worker(worker(&env, "", "parent")?))?;
    ensure!(message.contains("sees no device"), "{message}");
    let w = p.spawn_worker(worker(&env, "0,1,2", "parent")?)?;
    one_job(&mut p, w)?;
    p.stop_worker(w)?;
    env.assert_no_violations();
    Ok(())
}

#[test]
fn a_worker_on_a_peer_device_takes_tensors_by_pool_pointer() -> Result<()> {
    let (env, mut p) = machine(
        SimConfig {
            devices: 2,
            ..SimConfig::default()
        },
        0,
    )?;
    // Works on device 1, reads and writes the pool on device 0 through peer access: without
    // cuMemPoolSetAccess for device 1 the simulation would record NoAccess.
    let w = p.spawn_worker(worker(&env, "0,1", "any:1")?)?;
    ensure!(
        p.canary_report(w).is_some_and(poolipc::CanaryReport::ok),
        "canary battery: {:?}",
        p.canary_report(w)
    );
    let rungs = one_job_by(&mut p, w)?;
    ensure!(rungs == (Rung::PoolPointer, Rung::PoolPointer), "{rungs:?}");
    // The same devices under another visibility: machine device 1 is the worker's 0.
    let v = p.spawn_worker(worker(&env, "1,0", "any:0")?)?;
    let rungs = one_job_by(&mut p, v)?;
    ensure!(rungs == (Rung::PoolPointer, Rung::PoolPointer), "{rungs:?}");
    p.stop_worker(w)?;
    p.stop_worker(v)?;
    env.assert_no_violations();
    Ok(())
}

#[test]
fn a_worker_on_a_device_without_a_peer_path_takes_host_staging_both_ways() -> Result<()> {
    let (env, mut p) = machine(
        SimConfig {
            devices: 2,
            peer_access: false,
            ..SimConfig::default()
        },
        0,
    )?;
    let w = p.spawn_worker(worker(&env, "0,1", "any:1")?)?;
    ensure!(
        p.canary_report(w).is_none(),
        "no pool-pointer canaries for it"
    );
    for _ in 0..2 {
        let rungs = one_job_by(&mut p, w)?;
        ensure!(rungs == (Rung::HostStaging, Rung::HostStaging), "{rungs:?}");
    }
    // A worker on the pool's own device still goes by pool pointer.
    let v = p.spawn_worker(worker(&env, "0,1", "any:0")?)?;
    let rungs = one_job_by(&mut p, v)?;
    ensure!(rungs == (Rung::PoolPointer, Rung::PoolPointer), "{rungs:?}");
    p.stop_worker(w)?;
    p.stop_worker(v)?;
    env.assert_no_violations();
    Ok(())
}

#[test]
fn a_worker_that_sees_only_its_own_device_is_refused() -> Result<()> {
    let (env, mut p) = machine(
        SimConfig {
            devices: 2,
            ..SimConfig::default()
        },
        0,
    )?;
    let message = refusal(p.spawn_worker(worker(&env, "1", "any:0")?))?;
    ensure!(message.contains("sees 1"), "{message}");
    let w = p.spawn_worker(worker(&env, "1,0", "any:0")?)?;
    one_job(&mut p, w)?;
    p.stop_worker(w)?;
    env.assert_no_violations();
    Ok(())
}

/// A parent with a pool on device 0 (the first) and one on device 1.
fn pool_per_device(peer_access: bool) -> Result<(Env, Parent)> {
    let sim = Arc::new(SimDriver::new(SimConfig {
        devices: 2,
        peer_access,
        ..SimConfig::default()
    })?);
    sim.use_device(0)?;
    let env = Env {
        driver: sim.clone(),
        sim: Some(sim),
        device: 0,
    };
    let parent = Parent::new(
        Arc::clone(&env.driver),
        ParentOptions {
            device: 0,
            more_devices: vec![1],
            ..ParentOptions::default()
        },
    )?;
    Ok((env, parent))
}

/// One job through `worker`: 1 MiB from the pool on `input_on` lent, the result allocated
/// from the pool on `result_on`, both checked. Returns the rungs they took. Memory of a
/// device is filled and allocated on a stream of that device, as the hardware needs when the
/// devices are not peers; the job runs on a stream of the parent's first device.
fn cross_job(
    p: &mut Parent,
    worker: poolipc::WorkerId,
    input_on: u32,
    result_on: u32,
    pattern: u32,
) -> Result<(Rung, Rung)> {
    let d = Arc::clone(p.driver());
    let first = p.options().device;
    let on = |device: u32| -> Result<StreamHandle> {
        d.use_device(device)?;
        Ok(d.stream_create()?)
    };
    let (in_stream, out_stream) = (on(input_on)?, on(result_on)?);
    d.use_device(input_on)?;
    let input = p
        .pool_on(input_on)
        .ok_or_else(|| anyhow::anyhow!("no pool on {input_on}"))?
        .alloc(MIB, in_stream)?;
    echo::fill_pattern(&*d, input, MIB, pattern, in_stream)?;
    d.stream_synchronize(in_stream)?;
    let result_pool = p
        .pool_on(result_on)
        .ok_or_else(|| anyhow::anyhow!("no pool on {result_on}"))?
        .handle();
    let mut alloc = |_: &poolipc::ResultShape, bytes: u64| -> Result<DevicePtr, Error> {
        d.use_device(result_on)?;
        let ptr = d.mem_alloc_from_pool_async(bytes, result_pool, out_stream);
        d.stream_synchronize(out_stream)?;
        d.use_device(first)?;
        Ok(ptr?)
    };
    d.use_device(first)?;
    let stream = d.stream_create()?;
    let out = p.run_job_with(
        worker,
        &[Input {
            ptr: input,
            desc: TensorDesc::contiguous(DType::U8, &[MIB]),
        }],
        stream,
        &mut alloc,
    )?;
    d.stream_synchronize(stream)?;
    let mut got = [0u8; 8];
    d.memcpy_dtoh(&mut got, out.results[0].ptr)?;
    ensure!(got[4..] == pattern.to_le_bytes(), "result content {got:x?}");
    ensure!(
        d.pointer_get_mempool(out.results[0].ptr)? == result_pool,
        "the result lives where the allocator put it"
    );
    d.use_device(result_on)?;
    d.mem_free_async(out.results[0].ptr, out_stream)?;
    d.stream_synchronize(out_stream)?;
    d.use_device(input_on)?;
    d.mem_free_async(input, in_stream)?;
    d.stream_synchronize(in_stream)?;
    d.use_device(first)?;
    for s in [stream, in_stream, out_stream] {
        d.stream_destroy(s)?;
    }
    Ok((out.input_rungs[0], out.results[0].rung))
}

#[test]
fn a_pool_per_device_lends_and_allocates_across_devices_by_pointer_between_peers() -> Result<()> {
    let (env, mut p) = pool_per_device(true)?;
    let on0 = p.spawn_worker(worker(&env, "0,1", "0")?)?;
    let on1 = p.spawn_worker(worker(&env, "0,1", "any:1")?)?;
    let pointer = (Rung::PoolPointer, Rung::PoolPointer);
    // A tensor of device 1's pool read on device 0; a result on device 1 for a worker on 0.
    ensure!(cross_job(&mut p, on0, 1, 1, 0x1111_0001)? == pointer);
    // And the other way round.
    ensure!(cross_job(&mut p, on1, 0, 0, 0x1111_0002)? == pointer);
    ensure!(cross_job(&mut p, on1, 1, 0, 0x1111_0003)? == pointer);
    p.stop_worker(on0)?;
    p.stop_worker(on1)?;
    env.assert_no_violations();
    Ok(())
}

#[test]
fn a_pool_per_device_without_peer_paths_sends_the_other_devices_tensors_by_host_staging()
-> Result<()> {
    let (env, mut p) = pool_per_device(false)?;
    let on0 = p.spawn_worker(worker(&env, "0,1", "0")?)?;
    let on1 = p.spawn_worker(worker(&env, "0,1", "any:1")?)?;
    let (pointer, staging) = (Rung::PoolPointer, Rung::HostStaging);
    // Each worker takes its own device's pool by pointer and the other's by host staging.
    ensure!(cross_job(&mut p, on0, 0, 0, 0x2222_0001)? == (pointer, pointer));
    ensure!(cross_job(&mut p, on0, 1, 1, 0x2222_0002)? == (staging, staging));
    ensure!(cross_job(&mut p, on0, 1, 0, 0x2222_0003)? == (staging, pointer));
    ensure!(cross_job(&mut p, on1, 1, 1, 0x2222_0004)? == (pointer, pointer));
    ensure!(cross_job(&mut p, on1, 0, 1, 0x2222_0005)? == (staging, pointer));
    ensure!(cross_job(&mut p, on1, 0, 0, 0x2222_0006)? == (staging, staging));
    p.stop_worker(on0)?;
    p.stop_worker(on1)?;
    env.assert_no_violations();
    Ok(())
}

#[test]
fn a_device_listed_twice_is_a_configuration_error() -> Result<()> {
    let sim = Arc::new(SimDriver::new(SimConfig {
        devices: 2,
        ..SimConfig::default()
    })?);
    let got = Parent::new(
        sim,
        ParentOptions {
            device: 0,
            more_devices: vec![1, 0],
            ..ParentOptions::default()
        },
    );
    ensure!(
        matches!(&got, Err(Error::Config(m)) if m.contains("device 0 is listed twice")),
        "{:?}",
        got.err()
    );
    Ok(())
}
