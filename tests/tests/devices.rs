//! Several simulated devices: a worker whose `CUDA_VISIBLE_DEVICES` differs from the parent's
//! finds the parent's device by UUID, and one that cannot is refused with a reason on both
//! sides while the parent keeps serving. SimDriver only: the hardware half needs a machine
//! with two GPUs.

use std::sync::Arc;

use anyhow::{Result, ensure};
use poolipc::{DType, Error, Input, Parent, ParentOptions, TensorDesc, echo};
use poolipc_driver::sim::{SimConfig, SimDriver, VISIBLE_ENV};
use poolipc_driver::{Driver, DriverKind};
use poolipc_tests::{Env, worker_command};
use poolipc_transport::{ErrorCode, HandshakeError};

const MIB: u64 = 1 << 20;

/// A machine of three simulated devices, the parent on device 2.
fn three_devices() -> Result<(Env, Parent)> {
    let sim = Arc::new(SimDriver::new(SimConfig {
        devices: 3,
        ..SimConfig::default()
    })?);
    sim.use_device(2)?;
    let env = Env {
        driver: sim.clone(),
        sim: Some(sim),
        device: 2,
    };
    let parent = Parent::new(
        Arc::clone(&env.driver),
        ParentOptions {
            device: 2,
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
    Ok(())
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
