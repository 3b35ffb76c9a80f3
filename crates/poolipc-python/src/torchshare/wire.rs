//! The bytes a share travels as: [`Handle`] (which allocation, from whom) and [`Ref`] (which
//! share to release, with whom), inside torch's own tuple; and the frames a receiver sends its
//! sender over their connection. Decoding never trusts its input: a short, long or foreign
//! buffer is an error, never a panic.

use poolipc::advanced::driver::ExportBlob;

/// First bytes of a handle: what tells poolipc's handles from torch's own.
const HANDLE_MAGIC: &[u8] = b"POOLIPC-H1";
/// First bytes of a share reference.
const REF_MAGIC: &[u8] = b"POOLIPC-R1";

pub(super) const OP_POOL: u8 = 1;
pub(super) const OP_CLAIM: u8 = 2;
pub(super) const OP_RELEASE: u8 = 3;
/// Asks for the FD of a copy (an allocation above the pool-pointer import limit, copied
/// into a VMM allocation of its own): the reply is `[1]` with the FD, or `[0]`.
pub(super) const OP_COPY: u8 = 4;

/// Where a share's bytes live in the owner's process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Source {
    /// An allocation of the owner's pool of this generation, exported as `blob`.
    Pool { generation: u64, blob: ExportBlob },
    /// A copy the owner made into a VMM allocation of its own (the allocation passed the
    /// pool-pointer import limit), which it serves by FD under `id`.
    Copy { id: u64 },
}

const SOURCE_POOL: u8 = 1;
const SOURCE_COPY: u8 = 2;

/// Which allocation: the owner's socket name, where the bytes live there and the
/// allocation's size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Handle {
    pub(crate) owner: String,
    pub(crate) source: Source,
    pub(crate) alloc_bytes: u64,
}

/// Which share to release, with whom (the keeper: the process holding the block alive).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Ref {
    pub(crate) keeper: String,
    pub(crate) share: u64,
}

fn put_name(out: &mut Vec<u8>, name: &str) {
    // Names are ours and short (under 64 bytes): the length fits a byte.
    out.push(u8::try_from(name.len()).unwrap_or(u8::MAX));
    out.extend_from_slice(&name.as_bytes()[..name.len().min(255)]);
}

struct Reader<'a> {
    b: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    fn bad(&self) -> String {
        format!(
            "poolipc: a malformed {} (truncated or not poolipc's)",
            self.what
        )
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.b.len() < n {
            return Err(self.bad());
        }
        let (a, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(a)
    }
    fn u64(&mut self) -> Result<u64, String> {
        let a = self.take(8)?;
        let mut x = [0u8; 8];
        x.copy_from_slice(a);
        Ok(u64::from_le_bytes(x))
    }
    fn name(&mut self) -> Result<String, String> {
        let n = usize::from(self.take(1)?[0]);
        let a = self.take(n)?;
        String::from_utf8(a.to_vec()).map_err(|_| self.bad())
    }
    fn end(&self) -> Result<(), String> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(self.bad())
        }
    }
}

impl Handle {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = HANDLE_MAGIC.to_vec();
        put_name(&mut out, &self.owner);
        match self.source {
            Source::Pool { generation, blob } => {
                out.push(SOURCE_POOL);
                out.extend_from_slice(&generation.to_le_bytes());
                out.extend_from_slice(&blob.0);
            }
            Source::Copy { id } => {
                out.push(SOURCE_COPY);
                out.extend_from_slice(&id.to_le_bytes());
            }
        }
        out.extend_from_slice(&self.alloc_bytes.to_le_bytes());
        out
    }

    pub(crate) fn decode(b: &[u8]) -> Result<Handle, String> {
        let mut r = Reader {
            b,
            what: "share handle",
        };
        if r.take(HANDLE_MAGIC.len())? != HANDLE_MAGIC {
            return Err(r.bad());
        }
        let owner = r.name()?;
        let source = match r.take(1)?[0] {
            SOURCE_POOL => {
                let generation = r.u64()?;
                let mut blob = [0u8; 64];
                blob.copy_from_slice(r.take(64)?);
                Source::Pool {
                    generation,
                    blob: ExportBlob(blob),
                }
            }
            SOURCE_COPY => Source::Copy { id: r.u64()? },
            _ => return Err(r.bad()),
        };
        let alloc_bytes = r.u64()?;
        r.end()?;
        Ok(Handle {
            owner,
            source,
            alloc_bytes,
        })
    }
}

impl Ref {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = REF_MAGIC.to_vec();
        put_name(&mut out, &self.keeper);
        out.extend_from_slice(&self.share.to_le_bytes());
        out
    }

    pub(crate) fn decode(b: &[u8]) -> Result<Ref, String> {
        let mut r = Reader {
            b,
            what: "share reference",
        };
        if r.take(REF_MAGIC.len())? != REF_MAGIC {
            return Err(r.bad());
        }
        let keeper = r.name()?;
        let share = r.u64()?;
        r.end()?;
        Ok(Ref { keeper, share })
    }
}

pub(super) fn frame(op: u8, arg: u64) -> [u8; 9] {
    let mut f = [0u8; 9];
    f[0] = op;
    f[1..].copy_from_slice(&arg.to_le_bytes());
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_and_refs_round_trip_and_garbage_is_refused() {
        let h = Handle {
            owner: "poolipc-torch.1.abc".into(),
            source: Source::Pool {
                generation: 0xdead,
                blob: ExportBlob([7; 64]),
            },
            alloc_bytes: 4096,
        };
        assert_eq!(Handle::decode(&h.encode()), Ok(h.clone()));
        let c = Handle {
            owner: "poolipc-torch.2.def".into(),
            source: Source::Copy { id: 0xfeed },
            alloc_bytes: 6 << 30,
        };
        assert_eq!(Handle::decode(&c.encode()), Ok(c.clone()));
        let mut unknown = c.encode();
        unknown[HANDLE_MAGIC.len() + 1 + "poolipc-torch.2.def".len()] = 9;
        assert!(
            Handle::decode(&unknown).is_err(),
            "an unknown source is refused"
        );
        let r = Ref {
            keeper: "k".into(),
            share: 42,
        };
        assert_eq!(Ref::decode(&r.encode()), Ok(r));
        let mut long = h.encode();
        long.push(0);
        assert!(Handle::decode(&long).is_err());
        assert!(Handle::decode(&h.encode()[..20]).is_err());
        assert!(Handle::decode(b"torch's own handle").is_err());
        assert!(Ref::decode(&h.encode()).is_err(), "a handle is not a ref");
    }
}
