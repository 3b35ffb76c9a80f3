use super::*;
use poolipc_driver::sim::{SimConfig, SimDriver};
use poolipc_driver::{CuCode, DriverError, MockDriver, StreamHandle, VmmHandle};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

fn sim() -> Arc<SimDriver> {
    let d = SimDriver::new(SimConfig::default()).unwrap();
    d.use_device(0).unwrap();
    Arc::new(d)
}

fn granule(d: &SimDriver) -> u64 {
    d.vmm_granularity(0, Granularity::Recommended).unwrap()
}

fn assert_no_violations(d: &SimDriver) {
    let v = d.violations();
    assert!(v.is_empty(), "violations: {v:#?}");
}

#[test]
fn the_first_chunk_is_rounded_up_to_the_granularity_and_is_read_write_at_once() {
    let d = sim();
    let g = granule(&d);
    let arena = Arena::new(Arc::clone(&d), 0, 1).unwrap();
    assert_eq!(arena.capacity(), g);
    let b = arena.alloc(4096).unwrap();
    d.memset_d8_async(b.ptr, 0x5a, b.len, StreamHandle::NULL)
        .unwrap();
    let mut back = vec![0u8; 4096];
    d.memcpy_dtoh(&mut back, b.ptr).unwrap();
    assert!(back.iter().all(|&x| x == 0x5a));
    assert_no_violations(&d);
}

#[test]
fn blocks_are_aligned_and_their_pointers_are_the_chunk_base_plus_offset() {
    let d = sim();
    let arena = Arena::new(Arc::clone(&d), 0, 4 * MIB).unwrap();
    let base = arena.chunks().next().unwrap().ptr;
    let a = arena.alloc(100).unwrap();
    let b = arena.alloc(1000).unwrap();
    for x in [a, b] {
        assert_eq!(x.offset % ALIGN, 0);
        assert_eq!(x.ptr.0 % ALIGN, 0);
        assert_eq!(x.ptr, base.offset(x.offset));
    }
    assert_eq!((a.len, b.len), (ALIGN, 2 * ALIGN));
}

#[test]
fn alloc_grows_by_a_chunk_when_no_free_range_holds_the_request() {
    let d = sim();
    let g = granule(&d);
    let arena = Arena::new(Arc::clone(&d), 0, g).unwrap();
    let first = arena.alloc(g).unwrap();
    assert_eq!(first.chunk, 0);
    let second = arena.alloc(g / 2).unwrap();
    assert_eq!(second.chunk, 1);
    // A request larger than the usual chunk gets a chunk of its own size.
    let big = arena.alloc(3 * g).unwrap();
    assert_eq!(big.chunk, 2);
    let lens: Vec<u64> = arena.chunks().map(|c| c.len).collect();
    assert_eq!(lens, vec![g, g, 3 * g]);
    assert_eq!(arena.stats().chunks, 3);
    d.memset_d8_async(big.ptr, 1, big.len, StreamHandle::NULL)
        .unwrap();
    assert_no_violations(&d);
}

#[test]
fn grow_adds_a_chunk_of_at_least_the_bytes_asked() {
    let d = sim();
    let g = granule(&d);
    let arena = Arena::new(Arc::clone(&d), 0, g).unwrap();
    assert_eq!(arena.grow(g + 1).unwrap(), 1);
    assert_eq!(arena.capacity(), 3 * g);
    assert!(matches!(
        arena.grow(0),
        Err(ArenaError::BadSize { bytes: 0, .. })
    ));
}

#[test]
fn growth_past_the_cap_is_exhausted_and_names_the_request_and_the_capacity() {
    let d = sim();
    let g = granule(&d);
    let arena = Arena::with_max_bytes(Arc::clone(&d), 0, g, Some(2 * g)).unwrap();
    let _a = arena.alloc(g).unwrap();
    let _b = arena.alloc(g).unwrap();
    let e = arena.alloc(1).unwrap_err();
    assert!(
        matches!(
            e,
            ArenaError::Exhausted {
                requested: 1,
                capacity,
                max,
            } if capacity == 2 * g && max == 2 * g
        ),
        "{e}"
    );
    assert_eq!(arena.capacity(), 2 * g);
    assert!(matches!(arena.grow(1), Err(ArenaError::Exhausted { .. })));
}

#[test]
fn a_growth_chunk_shrinks_to_what_the_request_needs_when_the_cap_is_near() {
    let d = sim();
    let g = granule(&d);
    let arena = Arena::with_max_bytes(Arc::clone(&d), 0, 4 * g, Some(5 * g)).unwrap();
    let _a = arena.alloc(4 * g).unwrap();
    let b = arena.alloc(g).unwrap();
    assert_eq!(b.chunk, 1);
    assert_eq!(arena.capacity(), 5 * g);
}

#[test]
fn an_initial_size_over_the_cap_is_refused() {
    let d = sim();
    let g = granule(&d);
    let e = Arena::with_max_bytes(Arc::clone(&d), 0, 2 * g, Some(g)).unwrap_err();
    assert!(matches!(e, ArenaError::Exhausted { .. }), "{e}");
    let (free, total) = d.mem_get_info().unwrap();
    assert_eq!(free, total, "nothing was created");
}

#[test]
fn an_arena_with_a_budget_starts_empty_and_grows_by_its_chunk_size_at_its_first_block() {
    let d = sim();
    let g = granule(&d);
    let start = free_bytes(&d);
    let budget = Arc::new(ArenaBudget::new(None));
    let arena = Arena::with_budget(Arc::clone(&d), 0, 2 * g, Arc::clone(&budget)).unwrap();
    assert_eq!((arena.capacity(), arena.chunks().count()), (0, 0));
    assert_eq!(free_bytes(&d), start, "no chunk before the first block");
    let b = arena.alloc(4096).unwrap();
    assert_eq!((b.chunk, arena.capacity()), (0, 2 * g));
    assert_eq!(budget.used(), 2 * g);
    assert_no_violations(&d);
}

#[test]
fn arenas_sharing_a_budget_never_hold_more_than_its_cap_together() {
    let d = sim();
    let g = granule(&d);
    let budget = Arc::new(ArenaBudget::new(Some(3 * g)));
    let first = Arena::with_budget(Arc::clone(&d), 0, 2 * g, Arc::clone(&budget)).unwrap();
    let second = Arena::with_budget(Arc::clone(&d), 0, 2 * g, Arc::clone(&budget)).unwrap();
    let a = first.alloc(g).unwrap();
    assert_eq!(budget.used(), 2 * g);
    // Room for one granule only: the second arena's chunk shrinks to what the block needs.
    let b = second.alloc(g).unwrap();
    assert_eq!(second.capacity(), g);
    assert_eq!(budget.used(), 3 * g);
    let e = second.alloc(1).unwrap_err();
    assert!(
        matches!(e, ArenaError::Exhausted { requested: 1, capacity, max } if capacity == 3 * g && max == 3 * g),
        "{e}"
    );
    assert!(matches!(first.grow(1), Err(ArenaError::Exhausted { .. })));
    assert_eq!(second.max_bytes(), Some(3 * g));
    // A chunk released gives its bytes back to the budget, for any arena sharing it.
    second.free(b).unwrap();
    assert_eq!(
        second.release_idle(Instant::now(), Duration::ZERO, 0).len(),
        1
    );
    assert_eq!(budget.used(), 2 * g);
    let c = first.alloc(g).unwrap();
    assert_eq!(
        (c.chunk, first.capacity()),
        (0, 2 * g),
        "room in its own chunk"
    );
    let big = second.alloc(g).unwrap();
    assert_eq!(budget.used(), 3 * g);
    // A dropped arena gives back every chunk it held.
    second.free(big).unwrap();
    drop(second);
    assert_eq!(budget.used(), 2 * g);
    first.free(a).unwrap();
    first.free(c).unwrap();
    drop(first);
    assert_eq!(budget.used(), 0);
    assert_no_violations(&d);
}

#[test]
fn zero_bytes_are_refused_for_the_arena_and_for_a_block() {
    let d = sim();
    assert!(matches!(
        Arena::new(Arc::clone(&d), 0, 0),
        Err(ArenaError::BadSize { bytes: 0, .. })
    ));
    let arena = Arena::new(Arc::clone(&d), 0, 1).unwrap();
    assert!(matches!(
        arena.alloc(0),
        Err(ArenaError::Alloc(AllocError::ZeroSize))
    ));
}

#[test]
fn a_freed_block_is_reused() {
    let d = sim();
    let g = granule(&d);
    let arena = Arena::new(Arc::clone(&d), 0, g).unwrap();
    let a = arena.alloc(g).unwrap();
    arena.free(a).unwrap();
    let b = arena.alloc(g).unwrap();
    assert_eq!(a, b);
    assert_eq!(arena.stats().chunks, 1);
}

#[test]
fn a_double_free_is_a_typed_error() {
    let d = sim();
    let arena = Arena::new(Arc::clone(&d), 0, 1).unwrap();
    let a = arena.alloc(10).unwrap();
    arena.free(a).unwrap();
    let e = arena.free(a).unwrap_err();
    assert!(
        matches!(e, ArenaError::Alloc(AllocError::NotLive { chunk: 0, .. })),
        "{e}"
    );
}

#[test]
fn a_block_of_another_arena_is_refused() {
    let d = sim();
    let one = Arena::new(Arc::clone(&d), 0, 1).unwrap();
    let two = Arena::new(Arc::clone(&d), 0, 1).unwrap();
    let a = one.alloc(10).unwrap();
    let _b = two.alloc(10).unwrap();
    let e = two.free(a).unwrap_err();
    assert!(
        matches!(e, ArenaError::ForeignBlock { chunk: 0, .. }),
        "{e}"
    );
    let e = two.free(ArenaBlock { chunk: 9, ..a }).unwrap_err();
    assert!(
        matches!(e, ArenaError::Alloc(AllocError::UnknownChunk { chunk: 9 })),
        "{e}"
    );
    one.free(a).unwrap();
}

#[test]
fn blocks_are_freed_from_other_threads() {
    let d = sim();
    let arena = Arc::new(Arena::new(Arc::clone(&d), 0, 8 * MIB).unwrap());
    let blocks: Vec<ArenaBlock> = (0..64).map(|_| arena.alloc(4096).unwrap()).collect();
    let handles: Vec<_> = blocks
        .chunks(16)
        .map(|part| {
            let part = part.to_vec();
            let arena = Arc::clone(&arena);
            std::thread::spawn(move || {
                for b in part {
                    arena.free(b).unwrap();
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let s = arena.stats();
    assert_eq!((s.used, s.live_blocks, s.free_ranges), (0, 0, 1));
}

#[test]
fn the_arena_is_send_and_sync() {
    fn both<T: Send + Sync>() {}
    both::<Arena<SimDriver>>();
    both::<Arena<dyn Driver>>();
}

#[test]
fn chunks_list_every_chunk_and_export_fd_refuses_an_unknown_one() {
    let d = sim();
    let g = granule(&d);
    let arena = Arena::new(Arc::clone(&d), 0, g).unwrap();
    arena.grow(2 * g).unwrap();
    let list: Vec<(u32, u64)> = arena.chunks().map(|c| (c.index, c.len)).collect();
    assert_eq!(list, vec![(0, g), (1, 2 * g)]);
    arena.export_fd(1).unwrap();
    assert!(matches!(
        arena.export_fd(2),
        Err(ArenaError::UnknownChunk { chunk: 2 })
    ));
}

#[test]
fn drop_unmaps_frees_and_releases_every_chunk() {
    let d = sim();
    let g = granule(&d);
    let (free_before, _) = d.mem_get_info().unwrap();
    let arena = Arena::new(Arc::clone(&d), 0, g).unwrap();
    arena.grow(g).unwrap();
    let b = arena.alloc(10).unwrap();
    assert_eq!(d.mem_get_info().unwrap().0, free_before - 2 * g);
    drop(arena);
    assert_eq!(d.mem_get_info().unwrap().0, free_before);
    let mut byte = [0u8; 1];
    assert!(d.memcpy_dtoh(&mut byte, b.ptr).is_err(), "still mapped");
}

fn failed(call: &'static str) -> DriverError {
    DriverError::Call {
        call,
        code: CuCode::INVALID_VALUE,
    }
}

#[test]
fn a_chunk_whose_access_cannot_be_set_is_unmapped_freed_and_released() {
    let mut d = MockDriver::new();
    d.expect_vmm_granularity().returning(|_, _| Ok(2 * MIB));
    d.expect_vmm_create()
        .times(1)
        .returning(|_, _| Ok(VmmHandle::mock(7)));
    d.expect_vmm_reserve()
        .times(1)
        .returning(|_, _| Ok(DevicePtr(0x1000_0000)));
    d.expect_vmm_map().times(1).returning(|_, _, _| Ok(()));
    d.expect_vmm_set_access()
        .times(1)
        .returning(|_, _, _, _| Err(failed("cuMemSetAccess")));
    d.expect_vmm_unmap()
        .withf(|p, n| *p == DevicePtr(0x1000_0000) && *n == 2 * MIB)
        .times(1)
        .returning(|_, _| Ok(()));
    d.expect_vmm_address_free()
        .times(1)
        .returning(|_, _| Ok(()));
    d.expect_vmm_release()
        .withf(|h| *h == VmmHandle::mock(7))
        .times(1)
        .returning(|_| Ok(()));
    let e = Arena::new(Arc::new(d), 0, 1).unwrap_err();
    assert!(e.to_string().contains("cuMemSetAccess"), "{e}");
}

#[test]
fn a_chunk_that_cannot_be_mapped_frees_its_address_range_and_releases_its_handle() {
    let mut d = MockDriver::new();
    d.expect_vmm_granularity().returning(|_, _| Ok(2 * MIB));
    d.expect_vmm_create()
        .returning(|_, _| Ok(VmmHandle::mock(7)));
    d.expect_vmm_reserve()
        .returning(|_, _| Ok(DevicePtr(0x1000_0000)));
    d.expect_vmm_map()
        .returning(|_, _, _| Err(failed("cuMemMap")));
    d.expect_vmm_unmap().never();
    d.expect_vmm_address_free()
        .times(1)
        .returning(|_, _| Ok(()));
    d.expect_vmm_release().times(1).returning(|_| Ok(()));
    let e = Arena::new(Arc::new(d), 0, 1).unwrap_err();
    assert!(e.to_string().contains("cuMemMap"), "{e}");
}

#[test]
fn a_failing_teardown_step_is_logged_and_the_rest_still_runs() {
    let mut d = MockDriver::new();
    d.expect_vmm_granularity().returning(|_, _| Ok(2 * MIB));
    d.expect_vmm_create()
        .returning(|_, _| Ok(VmmHandle::mock(7)));
    d.expect_vmm_reserve()
        .returning(|_, _| Ok(DevicePtr(0x1000_0000)));
    d.expect_vmm_map().returning(|_, _, _| Ok(()));
    d.expect_vmm_set_access().returning(|_, _, _, _| Ok(()));
    d.expect_vmm_unmap()
        .times(1)
        .returning(|_, _| Err(failed("cuMemUnmap")));
    // A range still mapped cannot be freed: not tried.
    d.expect_vmm_address_free().never();
    d.expect_vmm_release().times(1).returning(|_| Ok(()));
    let arena = Arena::new(Arc::new(d), 0, 1).unwrap();
    drop(arena);
}

#[test]
fn a_block_freed_after_an_event_is_reused_once_the_event_completed_and_not_before() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let done = Arc::new(AtomicBool::new(false));
    let mut d = MockDriver::new();
    d.expect_vmm_granularity().returning(|_, _| Ok(2 * MIB));
    d.expect_vmm_create()
        .returning(|_, _| Ok(VmmHandle::mock(7)));
    d.expect_vmm_reserve()
        .returning(|_, _| Ok(DevicePtr(0x1000_0000)));
    d.expect_vmm_map().returning(|_, _, _| Ok(()));
    d.expect_vmm_set_access().returning(|_, _, _, _| Ok(()));
    d.expect_event_create()
        .returning(|_, _| Ok(poolipc_driver::EventHandle::mock(42)));
    let flag = Arc::clone(&done);
    d.expect_event_query()
        .returning(move |_| Ok(flag.load(Ordering::SeqCst)));
    // The refused second return drops its event; the reclaimed one goes with its block.
    d.expect_event_destroy().times(2).returning(|_| Ok(()));
    d.expect_vmm_unmap().returning(|_, _| Ok(()));
    d.expect_vmm_address_free().returning(|_, _| Ok(()));
    d.expect_vmm_release().returning(|_| Ok(()));
    let d = Arc::new(d);
    let arena = Arena::new(Arc::clone(&d), 0, 2 * MIB).unwrap();
    let block = arena.alloc(2 * MIB).unwrap();
    let as_dyn: Arc<dyn Driver> = d;
    let event = OwnedEvent::new(Arc::clone(&as_dyn), false).unwrap();
    arena.free_after(block, event).unwrap();
    assert_eq!(arena.pending_frees(), 1);
    // Returning it again while it is pending is refused.
    let again = OwnedEvent::new(as_dyn, false).unwrap();
    assert!(arena.free_after(block, again).is_err());
    // Not complete: the block stays out and the arena is full.
    assert_eq!(arena.reclaim(), 0);
    assert_eq!(arena.stats().live_blocks, 1);
    done.store(true, Ordering::SeqCst);
    assert_eq!(arena.reclaim(), 1);
    assert_eq!(arena.pending_frees(), 0);
    assert_eq!(arena.alloc(2 * MIB).unwrap(), block);
}

#[test]
fn alloc_reclaims_completed_stream_ordered_frees_first() {
    let d = sim();
    let g = granule(&d);
    let arena = Arena::with_max_bytes(Arc::clone(&d), 0, g, Some(g)).unwrap();
    let block = arena.alloc(g).unwrap();
    let as_dyn: Arc<dyn Driver> = d.clone();
    let event = OwnedEvent::new(as_dyn, false).unwrap();
    d.event_record(event.handle(), StreamHandle::NULL).unwrap();
    // Completed: the GPU ran the record (streams run asynchronously).
    d.event_synchronize(event.handle()).unwrap();
    arena.free_after(block, event).unwrap();
    // At the cap: only the reclaimed block can serve this.
    assert_eq!(arena.alloc(g).unwrap(), block);
    assert_eq!(arena.pending_frees(), 0);
    assert_no_violations(&d);
}

#[test]
fn a_split_block_gives_pieces_at_the_parents_addresses_that_free_back_to_the_whole() {
    let d = sim();
    let arena = Arena::new(Arc::clone(&d), 0, 4 * MIB).unwrap();
    let before = arena.stats();
    let b = arena.alloc(8 * ALIGN).unwrap();
    let (x, y) = arena.split(b, 3 * ALIGN).unwrap();
    assert_eq!((x.ptr, x.len), (b.ptr, 3 * ALIGN));
    assert_eq!(
        (y.ptr, y.offset, y.len),
        (b.ptr.offset(3 * ALIGN), b.offset + 3 * ALIGN, 5 * ALIGN)
    );
    assert!(arena.free(b).is_err(), "the whole block is no longer live");
    arena.free(y).unwrap();
    arena.free(x).unwrap();
    assert_eq!(arena.stats(), before);
}

#[test]
fn a_block_given_back_stream_ordered_cannot_be_split() {
    let d = sim();
    let arena = Arena::new(Arc::clone(&d), 0, 4 * MIB).unwrap();
    let b = arena.alloc(4 * ALIGN).unwrap();
    let event = OwnedEvent::new(Arc::clone(&d) as Arc<dyn Driver>, false).unwrap();
    arena.free_after(b, event).unwrap();
    assert!(arena.split(b, ALIGN).is_err());
}

fn free_bytes(d: &SimDriver) -> u64 {
    d.mem_get_info().unwrap().0
}

#[test]
fn release_idle_gives_free_chunks_back_to_the_device_and_never_reuses_their_indices() {
    let d = sim();
    let g = granule(&d);
    let start = free_bytes(&d);
    let arena = Arena::new(Arc::clone(&d), 0, g).unwrap();
    let a = arena.alloc(g).unwrap();
    let b = arena.alloc(g).unwrap();
    assert_eq!((a.chunk, b.chunk), (0, 1));
    assert_eq!(free_bytes(&d), start - 2 * g);
    arena.free(a).unwrap();
    let now = Instant::now();
    let released = arena.release_idle(now, Duration::ZERO, 0);
    assert_eq!(released.iter().map(|c| c.index).collect::<Vec<_>>(), [0]);
    assert_eq!(
        free_bytes(&d),
        start - g,
        "the released chunk's memory is back"
    );
    assert_eq!(arena.capacity(), g);
    assert_eq!(arena.released(), (1, g));
    assert_eq!(arena.chunks().map(|c| c.index).collect::<Vec<_>>(), [1]);
    // A block of the released chunk is refused, not reused.
    assert!(matches!(
        arena.free(a),
        Err(ArenaError::Alloc(AllocError::UnknownChunk { chunk: 0 }))
    ));
    assert!(arena.export_fd(0).is_err());
    // The live chunk stays; once free it goes too, and the next block grows a new index.
    assert!(arena.release_idle(now, Duration::ZERO, 0).is_empty());
    arena.free(b).unwrap();
    assert_eq!(arena.release_idle(now, Duration::ZERO, 0).len(), 1);
    assert_eq!(arena.capacity(), 0);
    assert_eq!(free_bytes(&d), start);
    let c = arena.alloc(4096).unwrap();
    assert_eq!(c.chunk, 2);
    assert_eq!(arena.capacity(), g);
    assert_no_violations(&d);
}

#[test]
fn release_idle_waits_min_idle_from_when_it_first_saw_the_chunk_idle_and_keeps_the_floor() {
    let d = sim();
    let g = granule(&d);
    let arena = Arena::new(Arc::clone(&d), 0, g).unwrap();
    let a = arena.alloc(g).unwrap();
    let b = arena.alloc(g).unwrap();
    arena.free(a).unwrap();
    arena.free(b).unwrap();
    let t0 = Instant::now();
    let idle = Duration::from_secs(30);
    assert!(
        arena.release_idle(t0, idle, 0).is_empty(),
        "first seen idle now"
    );
    assert!(arena.release_idle(t0 + idle / 2, idle, 0).is_empty());
    // An allocation in chunk 1 restarts its clock.
    let c = arena.alloc(g).unwrap();
    arena.free(c).unwrap();
    let t1 = t0 + idle / 2;
    assert!(arena.release_idle(t1, idle, 0).is_empty());
    // Chunk 0 has been idle for `idle`, chunk 1 only since t1; the floor keeps one chunk.
    let released = arena.release_idle(t0 + idle, idle, g);
    assert_eq!(
        released.iter().map(|c| c.index).collect::<Vec<_>>(),
        [c.chunk ^ 1]
    );
    assert!(
        arena.release_idle(t1 + idle, idle, g).is_empty(),
        "the floor"
    );
    assert_eq!(arena.release_idle(t1 + idle, idle, 0).len(), 1);
    assert_eq!(arena.capacity(), 0);
}

#[test]
fn a_chunk_with_a_block_waiting_for_its_event_is_not_released_until_the_event_completed() {
    let d = sim();
    let g = granule(&d);
    let arena = Arena::new(Arc::clone(&d), 0, g).unwrap();
    let a = arena.alloc(g).unwrap();
    let as_dyn: Arc<dyn Driver> = Arc::clone(&d) as Arc<dyn Driver>;
    let owned_stream = poolipc_driver::OwnedStream::new(Arc::clone(&d)).unwrap();
    let stream = owned_stream.handle();
    d.memset_d8_async(a.ptr, 1, a.len, stream).unwrap();
    let event = OwnedEvent::new(Arc::clone(&as_dyn), false).unwrap();
    d.event_record(event.handle(), stream).unwrap();
    arena.free_after(a, event).unwrap();
    // Until the event is seen complete the chunk is not idle.
    loop {
        let released = arena.release_idle(Instant::now(), Duration::ZERO, 0);
        if !released.is_empty() {
            assert_eq!(arena.pending_frees(), 0, "released only once reclaimed");
            break;
        }
        assert_eq!(arena.pending_frees(), 1);
        std::thread::sleep(Duration::from_millis(1));
    }
    d.stream_synchronize(stream).unwrap();
    owned_stream.close().unwrap();
    assert_no_violations(&d);
}

mod release_property {
    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Op {
        Alloc(u64),
        Free(usize),
        Release { keep_chunks: u64 },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (1u64..=3 * 2 * MIB).prop_map(Op::Alloc),
            3 => any::<usize>().prop_map(Op::Free),
            2 => (0u64..3).prop_map(|keep_chunks| Op::Release { keep_chunks }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Over any sequence of allocations, frees and releases: a released chunk never held
        /// a live block, every live block stays in a listed chunk and stays writable, the
        /// floor holds, and the device gets back exactly the released bytes.
        #[test]
        fn a_chunk_with_a_live_block_is_never_released(ops in proptest::collection::vec(op(), 1..40)) {
            let d = sim();
            let g = granule(&d);
            let start = free_bytes(&d);
            let arena = Arena::new(Arc::clone(&d), 0, g).unwrap();
            let mut live: Vec<ArenaBlock> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc(bytes) => live.push(arena.alloc(bytes).unwrap()),
                    Op::Free(i) if !live.is_empty() => {
                        let b = live.swap_remove(i % live.len());
                        arena.free(b).unwrap();
                    }
                    Op::Free(_) => {}
                    Op::Release { keep_chunks } => {
                        let before = arena.capacity();
                        let released = arena.release_idle(Instant::now(), Duration::ZERO, keep_chunks * g);
                        for c in &released {
                            prop_assert!(live.iter().all(|b| b.chunk != c.index), "chunk {} released with a live block", c.index);
                        }
                        let gone: u64 = released.iter().map(|c| c.len).sum();
                        prop_assert_eq!(arena.capacity(), before - gone);
                        if gone > 0 {
                            prop_assert!(arena.capacity() >= keep_chunks * g);
                        }
                    }
                }
                let chunks: Vec<u32> = arena.chunks().map(|c| c.index).collect();
                for b in &live {
                    prop_assert!(chunks.contains(&b.chunk));
                    d.memset_d8_async(b.ptr, 7, b.len, StreamHandle::NULL).unwrap();
                }
                // A block is freed only after its last use completed (the arena's rule: after
                // the worker's DONE, or stream-ordered with `free_after`).
                d.ctx_synchronize().unwrap();
                prop_assert_eq!(arena.stats().used, live.iter().map(|b| b.len).sum::<u64>());
                prop_assert_eq!(free_bytes(&d), start - arena.capacity());
            }
            assert_no_violations(&d);
        }
    }
}
