//! Several devices. A worker whose `CUDA_VISIBLE_DEVICES` differs from the parent's finds the
//! parent's device by UUID, and one that cannot is refused with a reason on both sides while
//! the parent keeps serving; a worker on another device than the pool's takes tensors by pool
//! pointer through peer access, or by host staging where the devices cannot reach each other;
//! a parent with a pool per device lends from either and allocates results on either, by
//! pointer where the worker can use that pool and by host staging where not.
//!
//! The tests written with `two_devices!` run on a simulated machine of two devices here, and on
//! two real GPUs when the machine has them (else they print NOT RUN); what depends on the
//! hardware's peer access is read from `cuDeviceCanAccessPeer`. The rest needs the simulation
//! (devices without a peer path, hidden devices, a bad configuration).

use std::sync::Arc;

use anyhow::{Result, ensure};
use poolipc::advanced::RawDriver;
use poolipc::advanced::driver::sim::{SimConfig, SimDriver, VISIBLE_ENV};
use poolipc::advanced::driver::{CudaDriver, Driver, StreamHandle};
use poolipc::advanced::transport::{ErrorCode, HandshakeError};
use poolipc::{DType, Error, Input, Layout, Parent, ParentOptions, Rung};
use poolipc_tests::echo;
use poolipc_tests::{Env, worker_command};

const MIB: u64 = 1 << 20;

/// Two devices, simulated or real, and how to tell a worker which of them it sees.
struct Rig {
    /// The driver (and the simulation, to read violations back), on device 0.
    base: Env,
    /// `POOLIPC_SIM_VISIBLE_DEVICES` or `CUDA_VISIBLE_DEVICES`.
    visible_var: &'static str,
}

impl Rig {
    fn sim(peer_access: bool) -> Result<Rig> {
        let sim = Arc::new(SimDriver::new(SimConfig {
            devices: 2,
            peer_access,
            ..SimConfig::default()
        })?);
        Ok(Rig {
            base: Env {
                driver: sim.clone(),
                sim: Some(sim),
                device: 0,
            },
            visible_var: VISIBLE_ENV,
        })
    }

    /// The real driver with at least two devices, or why not.
    fn cuda() -> std::result::Result<Rig, String> {
        let d = CudaDriver::new().map_err(|e| format!("no usable GPU: {e}"))?;
        let n = d.device_count().map_err(|e| e.to_string())?;
        if n < 2 {
            return Err(format!("needs two GPUs, this machine has {n}"));
        }
        Ok(Rig {
            base: Env {
                driver: Arc::new(d),
                sim: None,
                device: 0,
            },
            visible_var: "CUDA_VISIBLE_DEVICES",
        })
    }

    /// The environment of a test on `device`.
    fn env(&self, device: u32) -> Result<Env> {
        self.driver().use_device(device)?;
        Ok(Env {
            device,
            ..self.base.clone()
        })
    }

    fn driver(&self) -> &dyn Driver {
        &*self.base.driver
    }

    /// A parent whose first pool is on `device`, with one more on each of `more`.
    fn parent(&self, device: u32, more: &[u32]) -> Result<(Env, Parent)> {
        let env = self.env(device)?;
        let parent = Parent::new(
            Arc::clone(&env.driver),
            ParentOptions {
                device,
                more_devices: more.to_vec(),
                ..ParentOptions::default()
            },
        )?;
        Ok((env, parent))
    }

    /// The visibility value naming this process's `ordinals` in that order, by UUID (indices
    /// would be the machine's, not this process's).
    fn visible(&self, ordinals: &[u32]) -> Result<String> {
        let uuids = ordinals
            .iter()
            .map(|&o| Ok(self.driver().device_info(o)?.uuid.to_string()))
            .collect::<Result<Vec<_>>>()?;
        Ok(uuids.join(","))
    }

    /// Whether `a` can reach `b`'s memory.
    fn peers(&self, a: u32, b: u32) -> Result<bool> {
        Ok(self.driver().device_can_access_peer(a, b)?)
    }

    /// The echo worker, seeing `ordinals` of ours (`None`: what we see), on `device`
    /// (`parent`, an ordinal, or `any:N`).
    fn worker(
        &self,
        env: &Env,
        ordinals: Option<&[u32]>,
        device: &str,
    ) -> Result<std::process::Command> {
        let mut cmd = worker_command(env, None)?;
        if let Some(o) = ordinals {
            cmd.env(self.visible_var, self.visible(o)?);
        }
        cmd.env("POOLIPC_TEST_DEVICE", device);
        Ok(cmd)
    }

    fn assert_no_violations(&self) {
        self.base.assert_no_violations();
    }
}

/// A test body run on two simulated devices and, when the machine has them, two GPUs.
macro_rules! two_devices {
    (fn $name:ident($rig:ident) $body:block) => {
        mod $name {
            use super::*;

            fn body($rig: &Rig) -> Result<()> $body

            #[test]
            fn on_sim_driver() {
                poolipc_tests::init_tracing();
                let rig = Rig::sim(true).expect("SimDriver");
                body(&rig).expect(concat!(stringify!($name), " on SimDriver"));
                rig.assert_no_violations();
            }

            #[test]
            fn on_two_gpus() {
                poolipc_tests::init_tracing();
                match Rig::cuda() {
                    Ok(rig) => {
                        body(&rig).expect(concat!(stringify!($name), " on two GPUs"));
                        println!("RAN on CudaDriver: {}", stringify!($name));
                    }
                    Err(why) => {
                        println!("NOT RUN on hardware: {} ({why})", stringify!($name));
                    }
                }
            }
        }
    };
}

/// One job through `worker`: 1 MiB lent, the echoed result checked.
fn one_job(p: &Parent, worker: poolipc::WorkerId) -> Result<()> {
    one_job_by(p, worker).map(|_| ())
}

/// [`one_job`], returning the rungs the input and the result took.
fn one_job_by(p: &Parent, worker: poolipc::WorkerId) -> Result<(Rung, Rung)> {
    let first = p.options().device;
    cross_job(p, worker, first, first, 0x600D_D00D)
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

/// One job through `worker`: 1 MiB from the pool on `input_on` lent, the result allocated
/// from the pool on `result_on`, both checked. Returns the rungs they took. Memory of a
/// device is filled and allocated on a stream of that device, as the hardware needs when the
/// devices are not peers; the job runs on a stream of the parent's first device.
fn cross_job(
    p: &Parent,
    worker: poolipc::WorkerId,
    input_on: u32,
    result_on: u32,
    pattern: u32,
) -> Result<(Rung, Rung)> {
    let d = Arc::clone(p.driver());
    let first = p.options().device;
    let on = |device: u32| -> Result<poolipc::advanced::driver::OwnedStream> {
        d.use_device(device)?;
        Ok(poolipc::advanced::driver::OwnedStream::new(Arc::clone(&d))?)
    };
    let (in_owned, out_owned) = (on(input_on)?, on(result_on)?);
    let (in_stream, out_stream) = (in_owned.handle(), out_owned.handle());
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
    // Runs on the parent's IO thread: it switches device there and back.
    let ad = Arc::clone(&d);
    let alloc = move |_: &poolipc::ResultShape, bytes: u64, _: StreamHandle| {
        ad.use_device(result_on)?;
        let ptr = ad.mem_alloc_from_pool_async(bytes, result_pool, out_stream);
        ad.stream_synchronize(out_stream)?;
        ad.use_device(first)?;
        Ok::<_, Error>(ptr?)
    };
    d.use_device(first)?;
    let owned = poolipc::advanced::driver::OwnedStream::new(Arc::clone(&d))?;
    let stream = owned.handle();
    let out = p
        .submit_with(
            worker,
            &[Input {
                ptr: input,
                desc: Layout::contiguous(DType::U8, &[MIB]),
                read_only: false,
            }],
            stream,
            Box::new(alloc),
        )?
        .wait()?;
    d.stream_synchronize(stream)?;
    let mut got = [0u8; 8];
    d.memcpy_dtoh(&mut got, out.results[0].ptr)?;
    ensure!(got[4..] == pattern.to_le_bytes(), "result content {got:x?}");
    ensure!(
        d.pointer_get_mempool(out.results[0].ptr)? == result_pool,
        "the result lives where the allocator put it"
    );
    d.use_device(result_on)?;
    poolipc::advanced::driver::PoolAllocation::claim(&*d, out.results[0].ptr)?.free(out_stream)?;
    d.stream_synchronize(out_stream)?;
    d.use_device(input_on)?;
    poolipc::advanced::driver::PoolAllocation::claim(&*d, input)?.free(in_stream)?;
    d.stream_synchronize(in_stream)?;
    d.use_device(first)?;
    for s in [owned, in_owned, out_owned] {
        s.close()?;
    }
    Ok((out.input_rungs[0], out.results[0].rung))
}

two_devices! {
    fn a_worker_that_sees_the_parents_device_under_another_ordinal_finds_it_by_uuid(rig) {
        let (env, p) = rig.parent(1, &[])?;
        // The parent's device 1 is the worker's 0.
        let w = p.spawn_worker(rig.worker(&env, Some(&[1, 0]), "parent")?)?;
        let parent_uuid = rig.driver().device_info(1)?.uuid;
        ensure!(
            p.worker(w).map(|i| i.identity.device.0) == Some(parent_uuid.0),
            "the worker's identity names the parent's device"
        );
        one_job(&p, w)?;
        one_job(&p, w)?;
        p.stop_worker(w)?;
        Ok(())
    }
}

two_devices! {
    fn a_worker_given_the_parents_ordinal_under_another_visibility_is_refused(rig) {
        let (env, p) = rig.parent(1, &[])?;
        // Its ordinal 1 is our device 0: a mismatch, found by UUID.
        let message = refusal(p.spawn_worker(rig.worker(&env, Some(&[1, 0]), "1")?))?;
        ensure!(message.contains("device mismatch"), "{message}");
        // The parent goes on: the next worker, on the right ordinal, works.
        let w = p.spawn_worker(rig.worker(&env, Some(&[1, 0]), "0")?)?;
        one_job(&p, w)?;
        p.stop_worker(w)?;
        Ok(())
    }
}

two_devices! {
    fn a_worker_that_does_not_see_the_parents_device_says_what_it_sees(rig) {
        let (env, p) = rig.parent(1, &[])?;
        let message = refusal(p.spawn_worker(rig.worker(&env, Some(&[0]), "parent")?))?;
        let visible_uuid = rig.driver().device_info(0)?.uuid.to_string();
        ensure!(message.contains("sees 1") && message.contains(&visible_uuid), "{message}");
        let w = p.spawn_worker(rig.worker(&env, None, "parent")?)?;
        one_job(&p, w)?;
        p.stop_worker(w)?;
        Ok(())
    }
}

two_devices! {
    fn a_worker_on_another_device_takes_tensors_by_pointer_where_it_is_a_peer(rig) {
        let (env, p) = rig.parent(0, &[])?;
        // Works on device 1 and uses the pool on device 0 through peer access: without
        // cuMemPoolSetAccess for device 1 the simulation records NoAccess.
        let expected = if rig.peers(1, 0)? {
            (Rung::PoolPointer, Rung::PoolPointer)
        } else {
            (Rung::HostStaging, Rung::HostStaging)
        };
        let w = p.spawn_worker(rig.worker(&env, None, "any:1")?)?;
        let rungs = one_job_by(&p, w)?;
        ensure!(rungs == expected, "{rungs:?}, expected {expected:?}");
        // The same devices under another visibility: our device 1 is the worker's 0.
        let v = p.spawn_worker(rig.worker(&env, Some(&[1, 0]), "any:0")?)?;
        let rungs = one_job_by(&p, v)?;
        ensure!(rungs == expected, "{rungs:?}, expected {expected:?}");
        p.stop_worker(w)?;
        p.stop_worker(v)?;
        Ok(())
    }
}

two_devices! {
    fn a_worker_that_sees_only_its_own_device_is_refused(rig) {
        let (env, p) = rig.parent(0, &[])?;
        let message = refusal(p.spawn_worker(rig.worker(&env, Some(&[1]), "any:0")?))?;
        ensure!(message.contains("sees 1"), "{message}");
        let w = p.spawn_worker(rig.worker(&env, Some(&[1, 0]), "any:0")?)?;
        one_job(&p, w)?;
        p.stop_worker(w)?;
        Ok(())
    }
}

two_devices! {
    fn a_pool_per_device_lends_and_allocates_across_devices(rig) {
        let (env, p) = rig.parent(0, &[1])?;
        let on0 = p.spawn_worker(rig.worker(&env, None, "0")?)?;
        let on1 = p.spawn_worker(rig.worker(&env, None, "any:1")?)?;
        let rung = |a: u32, b: u32| -> Result<Rung> {
            Ok(if a == b || rig.peers(a, b)? {
                Rung::PoolPointer
            } else {
                Rung::HostStaging
            })
        };
        // A tensor of device 1's pool read on device 0; a result on device 1 for a worker
        // on device 0; and the other way round.
        for (w, on, input_on, result_on, pattern) in [
            (on0, 0, 1, 1, 0x1111_0001),
            (on0, 0, 0, 1, 0x1111_0002),
            (on1, 1, 0, 0, 0x1111_0003),
            (on1, 1, 1, 0, 0x1111_0004),
            (on1, 1, 1, 1, 0x1111_0005),
        ] {
            let expected = (rung(on, input_on)?, rung(on, result_on)?);
            let got = cross_job(&p, w, input_on, result_on, pattern)?;
            ensure!(
                got == expected,
                "worker on {on}, input on {input_on}, result on {result_on}: {got:?}, expected {expected:?}"
            );
        }
        p.stop_worker(on0)?;
        p.stop_worker(on1)?;
        Ok(())
    }
}

two_devices! {
    fn the_peer_matrix_is_what_the_driver_says(rig) {
        // Printed for the record of a hardware run; the simulation's devices are peers.
        for a in 0..2 {
            for b in 0..2 {
                if a != b {
                    let peer = rig.peers(a, b)?;
                    println!("device {a} can access device {b}: {peer}");
                    if rig.base.sim.is_some() {
                        ensure!(peer, "simulated devices are peers by default");
                    }
                }
            }
        }
        Ok(())
    }
}

// ---- the simulation only ----------------------------------------------------------------

#[test]
fn a_worker_on_a_device_without_a_peer_path_takes_host_staging_both_ways() -> Result<()> {
    let rig = Rig::sim(false)?;
    let (env, p) = rig.parent(0, &[])?;
    let w = p.spawn_worker(rig.worker(&env, None, "any:1")?)?;
    ensure!(
        p.canary_report(w).is_none(),
        "no pool-pointer canaries for it"
    );
    for _ in 0..2 {
        let rungs = one_job_by(&p, w)?;
        ensure!(rungs == (Rung::HostStaging, Rung::HostStaging), "{rungs:?}");
    }
    // A worker on the pool's own device still goes by pool pointer.
    let v = p.spawn_worker(rig.worker(&env, None, "any:0")?)?;
    let rungs = one_job_by(&p, v)?;
    ensure!(rungs == (Rung::PoolPointer, Rung::PoolPointer), "{rungs:?}");
    p.stop_worker(w)?;
    p.stop_worker(v)?;
    rig.assert_no_violations();
    Ok(())
}

#[test]
fn a_worker_that_sees_no_device_is_refused_with_that_reason() -> Result<()> {
    // On hardware an empty CUDA_VISIBLE_DEVICES stops the worker before the handshake.
    let rig = Rig::sim(true)?;
    let (env, p) = rig.parent(1, &[])?;
    let mut cmd = worker_command(&env, None)?;
    cmd.env(VISIBLE_ENV, "")
        .env("POOLIPC_TEST_DEVICE", "parent");
    let message = refusal(p.spawn_worker(cmd))?;
    ensure!(message.contains("sees no device"), "{message}");
    rig.assert_no_violations();
    Ok(())
}

#[test]
fn a_pool_per_device_without_peer_paths_sends_the_other_devices_tensors_by_host_staging()
-> Result<()> {
    let rig = Rig::sim(false)?;
    let (env, p) = rig.parent(0, &[1])?;
    let on0 = p.spawn_worker(rig.worker(&env, None, "0")?)?;
    let on1 = p.spawn_worker(rig.worker(&env, None, "any:1")?)?;
    let (pointer, staging) = (Rung::PoolPointer, Rung::HostStaging);
    // Each worker takes its own device's pool by pointer and the other's by host staging.
    ensure!(cross_job(&p, on0, 0, 0, 0x2222_0001)? == (pointer, pointer));
    ensure!(cross_job(&p, on0, 1, 1, 0x2222_0002)? == (staging, staging));
    ensure!(cross_job(&p, on0, 1, 0, 0x2222_0003)? == (staging, pointer));
    ensure!(cross_job(&p, on1, 1, 1, 0x2222_0004)? == (pointer, pointer));
    ensure!(cross_job(&p, on1, 0, 1, 0x2222_0005)? == (staging, pointer));
    ensure!(cross_job(&p, on1, 0, 0, 0x2222_0006)? == (staging, staging));
    p.stop_worker(on0)?;
    p.stop_worker(on1)?;
    rig.assert_no_violations();
    Ok(())
}

#[test]
fn a_worker_that_dies_before_answering_an_extra_pool_fails_its_spawn_only() -> Result<()> {
    let rig = Rig::sim(true)?;
    let (env, p) = rig.parent(0, &[1])?;
    let mut dying = worker_command(&env, Some("before-extra-pool-reply"))?;
    dying.env("POOLIPC_TEST_DEVICE", "0");
    let got = p.spawn_worker(dying);
    ensure!(
        got.is_err(),
        "a worker that died mid-offer was taken: {got:?}"
    );
    // The parent goes on: the next worker gets both pools and works.
    let w = p.spawn_worker(rig.worker(&env, None, "0")?)?;
    ensure!(cross_job(&p, w, 1, 1, 0x3333_0001)? == (Rung::PoolPointer, Rung::PoolPointer));
    p.stop_worker(w)?;
    rig.assert_no_violations();
    Ok(())
}

#[test]
fn a_device_listed_twice_is_a_configuration_error() -> Result<()> {
    let rig = Rig::sim(true)?;
    let got = rig.parent(0, &[1, 0]);
    ensure!(
        matches!(&got, Err(e) if e.to_string().contains("device 0 is listed twice")),
        "{:?}",
        got.err()
    );
    Ok(())
}
