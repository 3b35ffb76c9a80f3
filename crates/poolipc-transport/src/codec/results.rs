//! `ResultRequest` (the worker asks for result memory) and `AllocationGrant` (the parent's
//! answer, one grant a result: granted, refused, or a block of the arena).

use poolipc_types::{AllocId, EventBlob, ExportBlob, HandoffId, JobId};

use super::wire::{Reader, Writer};
use super::{DecodeError, EncodeError};
use crate::message::{AllocationGrant, ErrorCode, ResultGrant, ResultRequest, ResultSpec};

/// Wire bytes of the smallest result spec (no dims), for the count check.
const MIN_SPEC_WIRE: usize = 1 + 1 + 8;

pub(super) fn encode_result_request(
    w: &mut Writer<'_>,
    req: &ResultRequest,
) -> Result<(), EncodeError> {
    w.u64(req.job.0);
    w.count("results", req.results.len())?;
    for r in &req.results {
        w.u8(r.dtype as u8);
        w.shape(&r.shape)?;
        w.u64(r.byte_len);
        w.check()?;
    }
    Ok(())
}

pub(super) fn decode_result_request(r: &mut Reader<'_>) -> Result<ResultRequest, DecodeError> {
    let job = JobId(r.u64("job")?);
    let n = r.list_count("results", MIN_SPEC_WIRE)?;
    let mut results = Vec::with_capacity(n);
    for _ in 0..n {
        results.push(ResultSpec {
            dtype: r.dtype()?,
            shape: r.shape()?,
            byte_len: r.u64("byte_len")?,
        });
    }
    Ok(ResultRequest { job, results })
}

/// A grant's kind byte.
const GRANT_GRANTED: u8 = 1;
const GRANT_REFUSED: u8 = 2;
const GRANT_ARENA: u8 = 3;

/// Wire bytes of the smallest grant (a refusal with an empty text), for the count check.
const MIN_GRANT_WIRE: usize = 1 + 2 + 2;

pub(super) fn encode_allocation_grant(
    w: &mut Writer<'_>,
    grant: &AllocationGrant,
) -> Result<(), EncodeError> {
    w.u64(grant.job.0);
    w.count("results", grant.results.len())?;
    for g in &grant.results {
        encode_grant(w, g)?;
        w.check()?;
    }
    Ok(())
}

pub(super) fn decode_allocation_grant(r: &mut Reader<'_>) -> Result<AllocationGrant, DecodeError> {
    let job = JobId(r.u64("job")?);
    let n = r.list_count("results", MIN_GRANT_WIRE)?;
    let mut results = Vec::with_capacity(n);
    for _ in 0..n {
        results.push(decode_grant(r)?);
    }
    Ok(AllocationGrant { job, results })
}

fn encode_grant(w: &mut Writer<'_>, g: &ResultGrant) -> Result<(), EncodeError> {
    match g {
        ResultGrant::Granted {
            handle,
            alloc,
            rung,
            pool,
            export,
            ready_event,
        } => {
            w.u8(GRANT_GRANTED);
            w.u64(handle.0);
            w.u64(alloc.0);
            w.u8(*rung as u8);
            w.u8(*pool);
            w.bytes(&export.0);
            w.bytes(&ready_event.0);
        }
        ResultGrant::Arena {
            handle,
            alloc,
            chunk,
            offset,
            bytes,
        } => {
            w.u8(GRANT_ARENA);
            w.u64(handle.0);
            w.u64(alloc.0);
            w.u32(*chunk);
            w.u64(*offset);
            w.u64(*bytes);
        }
        ResultGrant::Refused { code, message } => {
            w.u8(GRANT_REFUSED);
            w.u16(code.0);
            w.text("message", message)?;
        }
    }
    Ok(())
}

fn decode_grant(r: &mut Reader<'_>) -> Result<ResultGrant, DecodeError> {
    match r.u8("grant")? {
        GRANT_GRANTED => Ok(ResultGrant::Granted {
            handle: HandoffId(r.u64("handle")?),
            alloc: AllocId(r.u64("alloc")?),
            rung: r.rung()?,
            pool: r.u8("pool")?,
            export: ExportBlob(r.take("export")?),
            ready_event: EventBlob(r.take("ready_event")?),
        }),
        GRANT_ARENA => Ok(ResultGrant::Arena {
            handle: HandoffId(r.u64("handle")?),
            alloc: AllocId(r.u64("alloc")?),
            chunk: r.u32("chunk")?,
            offset: r.u64("offset")?,
            bytes: r.u64("bytes")?,
        }),
        GRANT_REFUSED => Ok(ResultGrant::Refused {
            code: ErrorCode(r.u16("code")?),
            message: r.text("message")?,
        }),
        value => Err(DecodeError::UnknownValue {
            kind: r.kind,
            field: "grant",
            value,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::super::{FrameLimits, encode};
    use super::*;
    use crate::message::Message;
    use poolipc_contract::{MAX_REFUSAL_TEXT_LEN, MAX_RESULTS_PER_REQUEST};
    use poolipc_types::Rung;

    #[test]
    fn a_grant_of_the_most_results_a_request_may_ask_fits_a_frame() {
        let refused = ResultGrant::Refused {
            code: ErrorCode::LIMIT,
            message: "x".repeat(MAX_REFUSAL_TEXT_LEN),
        };
        let granted = ResultGrant::Granted {
            handle: HandoffId(u64::MAX),
            alloc: AllocId(u64::MAX),
            rung: Rung::PoolPointer,
            pool: 255,
            export: ExportBlob([0xFF; 64]),
            ready_event: EventBlob([0xFF; 64]),
        };
        for entry in [refused, granted] {
            let grant = Message::AllocationGrant(AllocationGrant {
                job: JobId(u64::MAX),
                results: vec![entry; MAX_RESULTS_PER_REQUEST],
            });
            encode(&grant, FrameLimits::default()).expect("a full grant fits one frame");
        }
    }
}
