//! The two syscalls that move bytes and file descriptors: `sendmsg` and `recvmsg` with
//! `SCM_RIGHTS`. Both are non-blocking per call (`MSG_DONTWAIT`); waiting is the caller's,
//! through `poll` with a deadline.
//!
//! `recvmsg` is written against libc rather than nix: on `MSG_CTRUNC` nix refuses to walk the
//! control messages, but the descriptors that did fit were already installed in our table and
//! must be found to be closed.

use std::io::IoSlice;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::errno::Errno;
use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};

/// The most descriptors one `recvmsg` accepts. More than any frame expects, so a peer sending a
/// few too many is reported as such; beyond this the kernel truncates (`MSG_CTRUNC`).
pub(crate) const MAX_RECV_FDS: usize = 8;

/// Control buffer, aligned for `cmsghdr`, large enough for [`MAX_RECV_FDS`].
#[repr(C, align(8))]
struct CmsgBuf([u8; 128]);

const fn cmsg_space_for_fds(n: usize) -> usize {
    // SAFETY: CMSG_SPACE is pure arithmetic on its argument.
    unsafe { libc::CMSG_SPACE((n * size_of::<RawFd>()) as libc::c_uint) as usize }
}

const _: () = assert!(cmsg_space_for_fds(MAX_RECV_FDS) <= size_of::<CmsgBuf>());

/// Sends `data` (or a prefix of it) with `fds` attached. Returns the bytes sent; the FDs went
/// with them if that is more than zero.
pub(crate) fn send(
    sock: BorrowedFd<'_>,
    data: &[u8],
    fds: &[BorrowedFd<'_>],
) -> Result<usize, Errno> {
    let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let cmsg = [ControlMessage::ScmRights(&raw)];
    let cmsgs: &[ControlMessage<'_>] = if raw.is_empty() { &[] } else { &cmsg };
    let iov = [IoSlice::new(data)];
    loop {
        match sendmsg::<()>(
            sock.as_raw_fd(),
            &iov,
            cmsgs,
            MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL,
            None,
        ) {
            Err(Errno::EINTR) => continue,
            other => return other,
        }
    }
}

/// What one `recvmsg` gave.
#[derive(Debug)]
pub(crate) struct Received {
    /// Bytes read into the buffer; 0 means the peer closed.
    pub(crate) bytes: usize,
    /// Descriptors that arrived, owned from here on.
    pub(crate) fds: Vec<OwnedFd>,
    /// The kernel dropped control data (`MSG_CTRUNC`): more descriptors were sent than fit.
    pub(crate) truncated: bool,
}

/// Receives into `buf` (never more than `buf.len()` bytes), taking any descriptors that come
/// with them, close-on-exec.
pub(crate) fn recv(sock: BorrowedFd<'_>, buf: &mut [u8]) -> Result<Received, Errno> {
    let mut cmsg = CmsgBuf([0; 128]);
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    loop {
        // SAFETY: msghdr is a plain C struct; all-zero is a valid (empty) value.
        let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
        hdr.msg_iov = &mut iov;
        hdr.msg_iovlen = 1;
        hdr.msg_control = cmsg.0.as_mut_ptr().cast();
        hdr.msg_controllen = cmsg_space_for_fds(MAX_RECV_FDS);
        // SAFETY: `hdr` points at `iov` (which points at `buf`, valid for `buf.len()` bytes) and
        // at `cmsg` (valid and aligned for `msg_controllen` bytes); all outlive the call.
        let n = unsafe {
            libc::recvmsg(
                sock.as_raw_fd(),
                &mut hdr,
                libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC,
            )
        };
        if n < 0 {
            match Errno::last() {
                Errno::EINTR => continue,
                e => return Err(e),
            }
        }
        // Take ownership of every descriptor before anything else can fail.
        let fds = collect_fds(&hdr);
        return Ok(Received {
            bytes: n as usize,
            fds,
            truncated: hdr.msg_flags & libc::MSG_CTRUNC != 0,
        });
    }
}

/// Walks the control messages `recvmsg` filled in and wraps every `SCM_RIGHTS` descriptor in
/// an `OwnedFd`.
fn collect_fds(hdr: &libc::msghdr) -> Vec<OwnedFd> {
    let mut fds = Vec::new();
    // SAFETY: `hdr` was filled in by a successful recvmsg; its control pointer and length
    // describe our buffer, and the kernel shrank msg_controllen to what it wrote.
    let mut c = unsafe { libc::CMSG_FIRSTHDR(hdr) };
    while !c.is_null() {
        // SAFETY: CMSG_FIRSTHDR/CMSG_NXTHDR return either null or a pointer to a complete
        // cmsghdr inside the control buffer; the buffer is aligned for it.
        let cm = unsafe { &*c };
        if cm.cmsg_level == libc::SOL_SOCKET && cm.cmsg_type == libc::SCM_RIGHTS {
            // SAFETY: pure arithmetic.
            let header = unsafe { libc::CMSG_LEN(0) } as usize;
            let payload = cm.cmsg_len.saturating_sub(header);
            let count = payload / size_of::<RawFd>();
            // SAFETY: CMSG_DATA of a valid cmsghdr points at its payload, which the kernel
            // wrote in full (cmsg_len counts it and lies inside msg_controllen).
            let data = unsafe { libc::CMSG_DATA(c) }.cast::<RawFd>();
            for i in 0..count {
                // SAFETY: `i < count`, inside the payload; the payload may be unaligned for
                // RawFd, hence read_unaligned.
                let raw = unsafe { data.add(i).read_unaligned() };
                if raw >= 0 {
                    // SAFETY: the kernel just installed this descriptor in our table for this
                    // message; nothing else in the process knows its number yet.
                    fds.push(unsafe { OwnedFd::from_raw_fd(raw) });
                }
            }
        }
        // SAFETY: `c` is a valid cmsghdr inside `hdr`'s control buffer.
        c = unsafe { libc::CMSG_NXTHDR(hdr, c) };
    }
    fds
}
