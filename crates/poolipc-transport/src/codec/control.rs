//! The small messages of either side: `Refuse` and `Error` (a code and a text), `JobError`,
//! `Cancel`, `Heartbeat`, `Bye`.

use poolipc_types::JobId;

use super::wire::{Reader, Writer};
use super::{DecodeError, EncodeError};
use crate::message::ErrorCode;

/// `Refuse`, `Error`: code u16, message text.
pub(super) fn encode_coded(
    w: &mut Writer<'_>,
    code: ErrorCode,
    message: &str,
) -> Result<(), EncodeError> {
    w.u16(code.0);
    w.text("message", message)
}

pub(super) fn decode_coded(r: &mut Reader<'_>) -> Result<(ErrorCode, String), DecodeError> {
    Ok((ErrorCode(r.u16("code")?), r.text("message")?))
}

/// `JobError`: job u64, message text.
pub(super) fn encode_job_error(
    w: &mut Writer<'_>,
    job: JobId,
    message: &str,
) -> Result<(), EncodeError> {
    w.u64(job.0);
    w.text("message", message)
}

pub(super) fn decode_job_error(r: &mut Reader<'_>) -> Result<(JobId, String), DecodeError> {
    Ok((JobId(r.u64("job")?), r.text("message")?))
}

/// `Cancel`: job u64.
pub(super) fn encode_cancel(w: &mut Writer<'_>, job: JobId) {
    w.u64(job.0);
}

pub(super) fn decode_cancel(r: &mut Reader<'_>) -> Result<JobId, DecodeError> {
    Ok(JobId(r.u64("job")?))
}

/// `Heartbeat`: seq u64.
pub(super) fn encode_heartbeat(w: &mut Writer<'_>, seq: u64) {
    w.u64(seq);
}

pub(super) fn decode_heartbeat(r: &mut Reader<'_>) -> Result<u64, DecodeError> {
    r.u64("seq")
}
