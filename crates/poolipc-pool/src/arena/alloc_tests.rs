use super::*;
use proptest::prelude::*;

fn with_chunks(lens: &[u64]) -> ArenaAllocator {
    let mut a = ArenaAllocator::new();
    for &len in lens {
        a.add_chunk(len).unwrap();
    }
    a
}

fn block(chunk: u32, offset: u64, len: u64) -> Block {
    Block { chunk, offset, len }
}

// --- the checker -----------------------------------------------------------------------

/// Every invariant the allocator promises, checked from outside. `live` is what the caller
/// believes is allocated. Returns the first broken invariant.
fn check(a: &ArenaAllocator, live: &[Block]) -> Result<(), String> {
    let mut mine: Vec<Block> = live.to_vec();
    mine.sort();
    let theirs: Vec<Block> = a.live_blocks().collect();
    if mine != theirs {
        return Err(format!(
            "live blocks differ: caller {mine:?}, allocator {theirs:?}"
        ));
    }
    for b in &mine {
        let Some(clen) = a.chunk_len(b.chunk) else {
            return Err(format!("{b:?} names a chunk that does not exist"));
        };
        if b.len == 0 || b.end() > clen {
            return Err(format!(
                "{b:?} is empty or leaves its chunk of {clen} bytes"
            ));
        }
        if b.offset % ALIGN != 0 || b.len % ALIGN != 0 {
            return Err(format!("{b:?} is not aligned to {ALIGN}"));
        }
    }
    // Live and free together tile every chunk exactly: no overlap, no gap.
    let mut all: Vec<(Block, bool)> = mine.iter().map(|&b| (b, true)).collect();
    all.extend(a.free_ranges().map(|b| (b, false)));
    all.sort();
    let mut chunk = 0u32;
    let mut at = 0u64;
    let mut prev_free = false;
    for &(b, is_live) in &all {
        while b.chunk > chunk {
            if Some(at) != a.chunk_len(chunk) {
                return Err(format!("chunk {chunk} is covered up to {at} only"));
            }
            chunk += 1;
            at = 0;
            prev_free = false;
        }
        if b.offset != at {
            let what = if b.offset < at {
                "overlaps"
            } else {
                "leaves a gap before"
            };
            return Err(format!("{b:?} {what} offset {at} of chunk {chunk}"));
        }
        if !is_live && prev_free {
            return Err(format!(
                "free range {b:?} was not merged with the one before it"
            ));
        }
        if !is_live && b.len == 0 {
            return Err(format!("empty free range {b:?}"));
        }
        prev_free = !is_live;
        at = b.end();
    }
    let chunks = a.stats().chunks as u32;
    while chunk < chunks {
        if Some(at) != a.chunk_len(chunk) {
            return Err(format!("chunk {chunk} is covered up to {at} only"));
        }
        chunk += 1;
        at = 0;
    }
    // The size index agrees with the position index.
    let by_pos: BTreeSet<(u64, u32, u64)> = a
        .free_by_pos
        .iter()
        .map(|(&(c, o), &l)| (l, c, o))
        .collect();
    if by_pos != a.free_by_size {
        return Err("the size index and the position index disagree".into());
    }
    let s = a.stats();
    let used: u64 = mine.iter().map(|b| b.len).sum();
    let largest = a.free_ranges().map(|b| b.len).max().unwrap_or(0);
    if s.used != used || s.free != s.capacity - used || s.largest_free != largest {
        return Err(format!(
            "stats {s:?} disagree with used {used}, largest {largest}"
        ));
    }
    if s.live_blocks != mine.len() {
        return Err(format!(
            "stats count {} live, caller {}",
            s.live_blocks,
            mine.len()
        ));
    }
    Ok(())
}

#[derive(Clone, Debug)]
enum Op {
    Alloc {
        bytes: u64,
        align: u64,
    },
    Free {
        pick: usize,
    },
    AddChunk {
        len: u64,
    },
    /// Split a live block at `units` of [`ALIGN`] (modulo its length in units).
    Split {
        pick: usize,
        units: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1u64..=6 * ALIGN, 0u32..=13).prop_map(|(bytes, p)| Op::Alloc { bytes, align: 1 << p }),
        3 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        1 => (1u64..=32).prop_map(|units| Op::AddChunk { len: units * ALIGN }),
        2 => (any::<usize>(), 1u64..=6).prop_map(|(pick, units)| Op::Split { pick, units }),
    ]
}

fn chunk_lens() -> impl Strategy<Value = Vec<u64>> {
    prop::collection::vec((1u64..=32).prop_map(|u| u * ALIGN), 1..=3)
}

/// Runs `ops` on `a` (after adding `chunks`), checking every invariant after every step, then
/// frees everything and checks that each chunk is one free range again.
fn run(mut a: ArenaAllocator, chunks: &[u64], ops: &[Op]) -> Result<(), String> {
    for &len in chunks {
        a.add_chunk(len).map_err(|e| e.to_string())?;
    }
    let mut live: Vec<Block> = Vec::new();
    for op in ops {
        match *op {
            Op::Alloc { bytes, align } => match a.alloc(bytes, align) {
                Ok(b) => {
                    if b.len < bytes || b.offset % align != 0 {
                        return Err(format!("{b:?} does not serve {bytes} bytes at {align}"));
                    }
                    live.push(b);
                }
                Err(AllocError::NoSpace { len, .. }) => {
                    // At the base alignment, "no space" must be true.
                    if align <= ALIGN && a.stats().largest_free >= len {
                        return Err(format!("NoSpace for {len} with a free range that fits"));
                    }
                }
                Err(e) => return Err(format!("alloc({bytes}, {align}): {e}")),
            },
            Op::Free { pick } => {
                if !live.is_empty() {
                    let b = live.swap_remove(pick % live.len());
                    a.free(b).map_err(|e| e.to_string())?;
                    if a.free(b).is_ok() {
                        return Err(format!("a second free of {b:?} was accepted"));
                    }
                }
            }
            Op::AddChunk { len } => {
                a.add_chunk(len).map_err(|e| e.to_string())?;
            }
            Op::Split { pick, units } => {
                if !live.is_empty() {
                    let i = pick % live.len();
                    let b = live[i];
                    let n = b.len / ALIGN;
                    if n > 1 {
                        let at = (1 + units % (n - 1)) * ALIGN;
                        let (x, y) = a.split(b, at).map_err(|e| e.to_string())?;
                        if x.offset != b.offset || x.end() != y.offset || y.end() != b.end() {
                            return Err(format!("{b:?} split at {at} into {x:?} and {y:?}"));
                        }
                        if a.free(b).is_ok() {
                            return Err(format!("the whole of split {b:?} was freed"));
                        }
                        live.swap_remove(i);
                        live.push(x);
                        live.push(y);
                    } else if a.split(b, ALIGN).is_ok() {
                        return Err(format!("{b:?} split at its end"));
                    }
                }
            }
        }
        check(&a, &live)?;
    }
    for b in live.drain(..) {
        a.free(b).map_err(|e| e.to_string())?;
    }
    check(&a, &live)?;
    let s = a.stats();
    if s.free_ranges != s.chunks || s.used != 0 {
        return Err(format!(
            "after freeing everything: {} free ranges over {} chunks, {} used",
            s.free_ranges, s.chunks, s.used
        ));
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_allocs_and_frees_never_overlap_stay_in_chunks_and_coalesce_back_to_one_range_per_chunk(
        chunks in chunk_lens(),
        ops in prop::collection::vec(op(), 0..200),
    ) {
        if let Err(e) = run(ArenaAllocator::new(), &chunks, &ops) {
            return Err(TestCaseError::fail(e));
        }
    }
}

/// Splits `whole` at each of `cuts` (offsets in units of [`ALIGN`] from its start, any
/// order, duplicates and out-of-range ones skipped), then frees the pieces in the order
/// `order` gives; returns the pieces as split.
fn split_and_free(
    a: &mut ArenaAllocator,
    whole: Block,
    cuts: &[u64],
    order: &[usize],
) -> Result<Vec<Block>, String> {
    let mut pieces = vec![whole];
    for &cut in cuts {
        let at = whole.offset + cut * ALIGN;
        let Some(i) = pieces.iter().position(|p| p.offset < at && at < p.end()) else {
            continue;
        };
        let p = pieces[i];
        let (x, y) = a.split(p, at - p.offset).map_err(|e| e.to_string())?;
        pieces[i] = x;
        pieces.push(y);
        check(a, &pieces)?;
    }
    let mut left = pieces.clone();
    for &o in order {
        if left.is_empty() {
            break;
        }
        let b = left.swap_remove(o % left.len());
        a.free(b).map_err(|e| e.to_string())?;
        check(a, &left)?;
    }
    for b in left.drain(..) {
        a.free(b).map_err(|e| e.to_string())?;
    }
    check(a, &[])?;
    Ok(pieces)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn split_pieces_freed_in_any_order_coalesce_back_to_the_whole_arena(
        units in 1u64..=64,
        cuts in prop::collection::vec(1u64..64, 0..16),
        order in prop::collection::vec(any::<usize>(), 0..20),
    ) {
        let mut a = ArenaAllocator::new();
        a.add_chunk(units * ALIGN).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let whole = a.alloc(units * ALIGN, ALIGN).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let pieces = split_and_free(&mut a, whole, &cuts, &order).map_err(TestCaseError::fail)?;
        let total: u64 = pieces.iter().map(|p| p.len).sum();
        prop_assert_eq!(total, whole.len);
        let s = a.stats();
        prop_assert_eq!(s.free_ranges, 1);
        prop_assert_eq!(s.largest_free, units * ALIGN);
        prop_assert_eq!(s.live_blocks, 0);
    }
}

#[test]
fn a_split_point_outside_the_block_or_unaligned_is_refused_and_changes_nothing() {
    let mut a = with_chunks(&[8 * ALIGN]);
    let b = a.alloc(4 * ALIGN, ALIGN).unwrap();
    for at in [0, 4 * ALIGN, 5 * ALIGN, ALIGN + 1] {
        assert!(
            matches!(a.split(b, at), Err(AllocError::BadSplit { .. })),
            "split at {at}"
        );
    }
    assert!(a.is_live(&b));
    assert_eq!(a.stats().live_blocks, 1);
}

#[test]
fn a_block_that_is_not_live_cannot_be_split() {
    let mut a = with_chunks(&[8 * ALIGN]);
    let b = a.alloc(4 * ALIGN, ALIGN).unwrap();
    a.free(b).unwrap();
    assert!(matches!(a.split(b, ALIGN), Err(AllocError::NotLive { .. })));
    let c = a.alloc(4 * ALIGN, ALIGN).unwrap();
    let wrong = Block {
        len: 2 * ALIGN,
        ..c
    };
    assert!(matches!(
        a.split(wrong, ALIGN),
        Err(AllocError::WrongLen { .. })
    ));
}

/// The checker is worth something only if it catches a broken allocator: the same property
/// run against the mutant that never coalesces must fail.
#[test]
fn the_property_catches_an_allocator_that_does_not_coalesce() {
    // A fixed seed: the verdict must not depend on the run.
    let mut runner = proptest::test_runner::TestRunner::new_with_rng(
        ProptestConfig {
            cases: 512,
            failure_persistence: None,
            ..ProptestConfig::default()
        },
        proptest::test_runner::TestRng::deterministic_rng(
            proptest::test_runner::RngAlgorithm::ChaCha,
        ),
    );
    let strategy = (chunk_lens(), prop::collection::vec(op(), 0..200));
    let outcome = runner.run(&strategy, |(chunks, ops)| {
        run(ArenaAllocator::without_coalescing(), &chunks, &ops).map_err(TestCaseError::fail)
    });
    let Err(proptest::test_runner::TestError::Fail(why, _)) = outcome else {
        panic!("the mutant passed the property: {outcome:?}");
    };
    assert!(why.to_string().contains("merged"), "{why}");
}

#[test]
fn the_checker_rejects_the_mutant_on_two_adjacent_frees() {
    let mut a = ArenaAllocator::without_coalescing();
    a.add_chunk(4 * ALIGN).unwrap();
    let x = a.alloc(ALIGN, ALIGN).unwrap();
    let y = a.alloc(ALIGN, ALIGN).unwrap();
    a.free(x).unwrap();
    a.free(y).unwrap();
    let e = check(&a, &[]).unwrap_err();
    assert!(e.contains("not merged"), "{e}");
}

// --- behaviour, one test each ----------------------------------------------------------

#[test]
fn best_fit_takes_the_smallest_free_range_that_holds_the_request() {
    let mut a = with_chunks(&[8 * ALIGN, 3 * ALIGN, 5 * ALIGN]);
    let b = a.alloc(2 * ALIGN, ALIGN).unwrap();
    assert_eq!(b, block(1, 0, 2 * ALIGN));
    let c = a.alloc(4 * ALIGN, ALIGN).unwrap();
    assert_eq!(c, block(2, 0, 4 * ALIGN));
}

#[test]
fn requests_are_rounded_up_to_the_alignment() {
    let mut a = with_chunks(&[4 * ALIGN]);
    let b = a.alloc(1, 1).unwrap();
    assert_eq!(b, block(0, 0, ALIGN));
    let c = a.alloc(ALIGN + 1, 1).unwrap();
    assert_eq!(c, block(0, ALIGN, 2 * ALIGN));
    assert_eq!(a.stats().used, 3 * ALIGN);
}

#[test]
fn a_larger_alignment_leaves_its_padding_free() {
    let mut a = with_chunks(&[16 * ALIGN]);
    a.alloc(ALIGN, ALIGN).unwrap();
    let b = a.alloc(ALIGN, 4 * ALIGN).unwrap();
    assert_eq!(b.offset, 4 * ALIGN);
    let free: Vec<Block> = a.free_ranges().collect();
    assert_eq!(
        free,
        vec![block(0, ALIGN, 3 * ALIGN), block(0, 5 * ALIGN, 11 * ALIGN)]
    );
}

#[test]
fn a_freed_block_merges_with_free_neighbours_on_both_sides() {
    let mut a = with_chunks(&[3 * ALIGN]);
    let x = a.alloc(ALIGN, ALIGN).unwrap();
    let y = a.alloc(ALIGN, ALIGN).unwrap();
    let z = a.alloc(ALIGN, ALIGN).unwrap();
    a.free(x).unwrap();
    a.free(z).unwrap();
    assert_eq!(a.stats().free_ranges, 2);
    a.free(y).unwrap();
    let free: Vec<Block> = a.free_ranges().collect();
    assert_eq!(free, vec![block(0, 0, 3 * ALIGN)]);
}

#[test]
fn free_ranges_of_different_chunks_never_merge() {
    let mut a = with_chunks(&[ALIGN, ALIGN]);
    let x = a.alloc(ALIGN, ALIGN).unwrap();
    let y = a.alloc(ALIGN, ALIGN).unwrap();
    a.free(x).unwrap();
    a.free(y).unwrap();
    assert_eq!(a.stats().free_ranges, 2);
}

#[test]
fn a_block_never_spans_two_chunks() {
    let mut a = with_chunks(&[2 * ALIGN, 2 * ALIGN]);
    let e = a.alloc(3 * ALIGN, ALIGN).unwrap_err();
    assert_eq!(
        e,
        AllocError::NoSpace {
            len: 3 * ALIGN,
            align: ALIGN
        }
    );
}

#[test]
fn a_freed_block_is_handed_out_again() {
    let mut a = with_chunks(&[2 * ALIGN]);
    let x = a.alloc(2 * ALIGN, ALIGN).unwrap();
    assert!(matches!(a.alloc(1, 1), Err(AllocError::NoSpace { .. })));
    a.free(x).unwrap();
    assert_eq!(a.alloc(2 * ALIGN, ALIGN).unwrap(), x);
}

#[test]
fn a_double_free_is_an_error_and_changes_nothing() {
    let mut a = with_chunks(&[4 * ALIGN]);
    let x = a.alloc(ALIGN, ALIGN).unwrap();
    let y = a.alloc(ALIGN, ALIGN).unwrap();
    a.free(x).unwrap();
    let before = a.stats();
    let e = a.free(x).unwrap_err();
    assert_eq!(
        e,
        AllocError::NotLive {
            chunk: 0,
            offset: 0,
            len: ALIGN
        }
    );
    assert_eq!(a.stats(), before);
    check(&a, &[y]).unwrap();
}

#[test]
fn a_block_this_allocator_never_handed_out_is_refused() {
    let mut a = with_chunks(&[4 * ALIGN]);
    let _x = a.alloc(2 * ALIGN, ALIGN).unwrap();
    assert!(matches!(
        a.free(block(0, ALIGN, ALIGN)),
        Err(AllocError::NotLive { .. })
    ));
    assert_eq!(
        a.free(block(7, 0, ALIGN)),
        Err(AllocError::UnknownChunk { chunk: 7 })
    );
    assert_eq!(
        a.free(block(0, 0, ALIGN)),
        Err(AllocError::WrongLen {
            chunk: 0,
            offset: 0,
            len: ALIGN,
            live_len: 2 * ALIGN
        })
    );
}

#[test]
fn zero_bytes_bad_alignments_and_overflowing_sizes_are_refused() {
    let mut a = with_chunks(&[4 * ALIGN]);
    assert_eq!(a.alloc(0, ALIGN), Err(AllocError::ZeroSize));
    assert_eq!(a.alloc(1, 3), Err(AllocError::BadAlignment { align: 3 }));
    assert_eq!(a.alloc(1, 0), Err(AllocError::BadAlignment { align: 0 }));
    assert_eq!(
        a.alloc(u64::MAX, ALIGN),
        Err(AllocError::TooLarge { bytes: u64::MAX })
    );
    assert!(matches!(
        a.alloc(u64::MAX - 2 * ALIGN, 1 << 63),
        Err(AllocError::NoSpace { .. })
    ));
    assert_eq!(a.stats().used, 0);
}

#[test]
fn chunks_must_be_non_zero_multiples_of_the_alignment() {
    let mut a = ArenaAllocator::new();
    assert_eq!(a.add_chunk(0), Err(AllocError::BadChunkLen { len: 0 }));
    assert_eq!(
        a.add_chunk(ALIGN + 1),
        Err(AllocError::BadChunkLen { len: ALIGN + 1 })
    );
    assert_eq!(a.add_chunk(ALIGN), Ok(0));
    assert_eq!(a.add_chunk(2 * ALIGN), Ok(1));
}

#[test]
fn stats_count_capacity_use_and_the_largest_free_range() {
    let mut a = with_chunks(&[4 * ALIGN, 8 * ALIGN]);
    let x = a.alloc(3 * ALIGN, ALIGN).unwrap();
    let s = a.stats();
    assert_eq!(s.capacity, 12 * ALIGN);
    assert_eq!(s.used, 3 * ALIGN);
    assert_eq!(s.free, 9 * ALIGN);
    assert_eq!(s.largest_free, 8 * ALIGN);
    assert_eq!(s.live_blocks, 1);
    assert_eq!(s.chunks, 2);
    assert!(a.is_live(&x));
}
