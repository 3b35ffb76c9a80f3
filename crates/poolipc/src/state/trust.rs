//! How far the parent trusts one worker with its memory, chosen when the worker is spawned or
//! accepted ([`Parent::spawn_worker_with`](crate::Parent::spawn_worker_with)).

/// Whether a worker gets handles on the parent's memory beyond the tensors lent to it.
///
/// Chosen per worker at spawn ([`Parent::spawn_worker_with`](crate::Parent::spawn_worker_with),
/// [`Parent::accept_worker`](crate::Parent::accept_worker)); the plain
/// [`spawn_worker`](crate::Parent::spawn_worker) takes the parent's default,
/// [`ParentOptions::isolated`](crate::ParentOptions::isolated) (see [`Parent::default_trust`](crate::Parent::default_trust)).
/// A trusted and an isolated worker may serve the same parent side by side.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Trust {
    /// The worker is given the parent's pool (its FD in `Hello`, every later generation by
    /// `ExtraPool`) and VMM allocations by handle: pool tensors go to it by pointer, with no
    /// copy. It can read any memory of the pools it imported, not only what it was lent.
    Trusted,
    /// The worker gets no handle on the parent's memory: its `Hello` carries a sealed empty
    /// memfd where the pool's FD would be, the parent's capabilities leave pool pointers and
    /// VMM handles out, no pool generation is offered to it at a rotation. Its inputs cross
    /// by a copy into its own arena ([`Rung::ArenaCopy`](crate::Rung::ArenaCopy); host
    /// staging where no arena copy can be made) and its results come from that arena
    /// ([`Rung::Arena`](crate::Rung::Arena)), in chunks only it maps.
    Isolated,
}

impl Trust {
    /// The trust [`ParentOptions::isolated`](crate::ParentOptions::isolated) gives a worker
    /// spawned without a choice of its own.
    pub(crate) fn default_of(isolated: bool) -> Trust {
        if isolated {
            Trust::Isolated
        } else {
            Trust::Trusted
        }
    }

    /// Whether the worker is kept from the parent's memory.
    pub(crate) fn is_isolated(self) -> bool {
        matches!(self, Trust::Isolated)
    }
}

impl std::fmt::Display for Trust {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Trust::Trusted => "trusted",
            Trust::Isolated => "isolated",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::Trust;

    #[test]
    fn the_parents_isolated_option_picks_the_default_trust() {
        assert_eq!(Trust::default_of(true), Trust::Isolated);
        assert_eq!(Trust::default_of(false), Trust::Trusted);
        assert!(Trust::Isolated.is_isolated());
        assert!(!Trust::Trusted.is_isolated());
    }
}
