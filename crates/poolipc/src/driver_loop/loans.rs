//! The room's loans: the ids it gives allocations on the wire, the input allocations lent by
//! pool pointer (one id per allocation while any job holds it, so that a worker imports it
//! once), and the VMM allocations lent by handle with the workers that mapped them.

use std::collections::{HashMap, HashSet};

use poolipc_types::{AllocId, WorkerId};

/// A VMM allocation lent by handle ([`Rung::VmmHandle`](poolipc_types::Rung::VmmHandle)).
#[derive(Debug)]
struct VmmShared {
    /// The id lent tensors name it by.
    alloc: AllocId,
    /// Its size and `CU_POINTER_ATTRIBUTE_BUFFER_ID` when it was shared: an allocation at
    /// the same address with another of either is another allocation.
    size: u64,
    buffer_id: u64,
    /// The workers it was sent to that have not dropped their mappings.
    sent_to: HashSet<WorkerId>,
}

/// The ids, the pointer loans and the VMM shares of one room.
#[derive(Debug)]
pub(super) struct Loans {
    next: u64,
    /// Input allocations currently lent by pointer: base address to (id, loans).
    lent: HashMap<u64, (AllocId, u32)>,
    /// VMM allocations lent by handle, by base address.
    vmm: HashMap<u64, VmmShared>,
}

impl Default for Loans {
    fn default() -> Loans {
        Loans {
            next: 1,
            lent: HashMap::new(),
            vmm: HashMap::new(),
        }
    }
}

impl Loans {
    /// A new id, never given before in this room.
    pub(super) fn new_id(&mut self) -> AllocId {
        let id = AllocId(self.next);
        self.next += 1;
        id
    }

    /// The id of the allocation at `base` for a pointer loan: the one it has while lent,
    /// else a new one.
    pub(super) fn pointer_id(&mut self, base: u64) -> AllocId {
        match self.lent.get(&base) {
            Some((a, _)) => *a,
            None => self.new_id(),
        }
    }

    /// One more job holds the allocation at `base` lent by pointer as `alloc`.
    pub(super) fn lend_pointer(&mut self, base: u64, alloc: AllocId) {
        self.lent.entry(base).or_insert((alloc, 0)).1 += 1;
    }

    /// A job that held the allocation at `base` ended: forgotten once no job holds it.
    pub(super) fn return_pointer(&mut self, base: u64) {
        if let Some(e) = self.lent.get_mut(&base) {
            e.1 -= 1;
            if e.1 == 0 {
                self.lent.remove(&base);
            }
        }
    }

    /// The id of the VMM allocation at `base` (`size` bytes, `buffer_id`) if `worker` mapped
    /// it already: it needs no handle again.
    pub(super) fn vmm_mapped_by(
        &self,
        base: u64,
        size: u64,
        buffer_id: u64,
        worker: WorkerId,
    ) -> Option<AllocId> {
        self.vmm
            .get(&base)
            .filter(|e| e.size == size && e.buffer_id == buffer_id && e.sent_to.contains(&worker))
            .map(|e| e.alloc)
    }

    /// The id of the VMM allocation at `base`: the one it was shared under if it is the same
    /// allocation (size and buffer id), else a new one, so that no worker's mapping of an
    /// earlier allocation at this address is taken for it.
    pub(super) fn vmm_id(&mut self, base: u64, size: u64, buffer_id: u64) -> AllocId {
        match self.vmm.get(&base) {
            Some(e) if e.size == size && e.buffer_id == buffer_id => e.alloc,
            _ => {
                let alloc = self.new_id();
                self.vmm.insert(
                    base,
                    VmmShared {
                        alloc,
                        size,
                        buffer_id,
                        sent_to: HashSet::new(),
                    },
                );
                alloc
            }
        }
    }

    /// `worker` was sent the handle of the VMM allocation at `base`.
    pub(super) fn vmm_sent(&mut self, base: u64, worker: WorkerId) {
        if let Some(e) = self.vmm.get_mut(&base) {
            e.sent_to.insert(worker);
        }
    }

    /// Whether `worker` holds a mapping of a VMM allocation lent by handle.
    pub(super) fn vmm_held_by(&self, worker: WorkerId) -> bool {
        self.vmm.values().any(|e| e.sent_to.contains(&worker))
    }

    /// Forgets which VMM allocations `worker` mapped (reaped, or told to drop its cached
    /// mappings): an allocation lent to it again is sent again first.
    pub(super) fn forget_vmm(&mut self, worker: WorkerId) {
        self.vmm.retain(|_, e| {
            e.sent_to.remove(&worker);
            !e.sent_to.is_empty()
        });
    }
}

#[cfg(test)]
mod tests {
    use super::Loans;
    use poolipc_types::WorkerId;

    #[test]
    fn ids_are_never_given_twice() {
        let mut l = Loans::default();
        let a = l.new_id();
        let b = l.pointer_id(0x1000);
        let c = l.vmm_id(0x2000, 64, 1);
        assert!(a != b && b != c && a != c, "{a:?} {b:?} {c:?}");
        assert!(a.0 >= 1, "0 is never an id");
    }

    #[test]
    fn a_pointer_loan_keeps_its_id_while_any_job_holds_it() {
        let mut l = Loans::default();
        let a = l.pointer_id(0x1000);
        l.lend_pointer(0x1000, a);
        assert_eq!(l.pointer_id(0x1000), a, "lent: the same id");
        l.lend_pointer(0x1000, a);
        l.return_pointer(0x1000);
        assert_eq!(l.pointer_id(0x1000), a, "one job still holds it");
        l.return_pointer(0x1000);
        let b = l.pointer_id(0x1000);
        assert_ne!(b, a, "no job holds it: a new id");
        l.return_pointer(0x1000);
        assert_eq!(
            l.pointer_id(0x1000).0,
            b.0 + 1,
            "a return of nothing lent changes nothing"
        );
    }

    #[test]
    fn a_vmm_allocation_is_known_by_address_size_and_buffer_id_per_worker() {
        let (w1, w2) = (WorkerId(1), WorkerId(2));
        let mut l = Loans::default();
        let a = l.vmm_id(0x2000, 64, 7);
        assert_eq!(l.vmm_mapped_by(0x2000, 64, 7, w1), None, "not sent yet");
        l.vmm_sent(0x2000, w1);
        assert_eq!(l.vmm_mapped_by(0x2000, 64, 7, w1), Some(a));
        assert_eq!(l.vmm_mapped_by(0x2000, 64, 7, w2), None, "another worker");
        assert_eq!(l.vmm_id(0x2000, 64, 7), a, "the same allocation");
        assert!(l.vmm_held_by(w1) && !l.vmm_held_by(w2));
        let b = l.vmm_id(0x2000, 64, 8);
        assert_ne!(b, a, "another buffer at the same address");
        assert_eq!(
            l.vmm_mapped_by(0x2000, 64, 8, w1),
            None,
            "the new one was never sent"
        );
        l.vmm_sent(0x2000, w1);
        l.vmm_sent(0x2000, w2);
        l.forget_vmm(w1);
        assert!(!l.vmm_held_by(w1) && l.vmm_held_by(w2));
        l.forget_vmm(w2);
        assert!(!l.vmm_held_by(w2));
        assert_ne!(
            l.vmm_id(0x2000, 64, 8),
            b,
            "forgotten once no worker maps it"
        );
    }
}
