//! Errors of the driver layer: every failing call is named, every CUresult has its name.

use std::fmt;

/// A `CUresult` value other than success.
///
/// Both drivers produce these, so a test can expect the same code from the real driver and
/// from the simulation.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct CuCode(pub u32);

impl CuCode {
    /// `CUDA_ERROR_INVALID_VALUE`.
    pub const INVALID_VALUE: CuCode = CuCode(1);
    /// `CUDA_ERROR_OUT_OF_MEMORY`.
    pub const OUT_OF_MEMORY: CuCode = CuCode(2);
    /// `CUDA_ERROR_NOT_INITIALIZED`.
    pub const NOT_INITIALIZED: CuCode = CuCode(3);
    /// `CUDA_ERROR_DEINITIALIZED`.
    pub const DEINITIALIZED: CuCode = CuCode(4);
    /// `CUDA_ERROR_STUB_LIBRARY`.
    pub const STUB_LIBRARY: CuCode = CuCode(34);
    /// `CUDA_ERROR_NO_DEVICE`.
    pub const NO_DEVICE: CuCode = CuCode(100);
    /// `CUDA_ERROR_INVALID_DEVICE`.
    pub const INVALID_DEVICE: CuCode = CuCode(101);
    /// `CUDA_ERROR_INVALID_CONTEXT`.
    pub const INVALID_CONTEXT: CuCode = CuCode(201);
    /// `CUDA_ERROR_ALREADY_MAPPED`.
    pub const ALREADY_MAPPED: CuCode = CuCode(208);
    /// `CUDA_ERROR_INVALID_HANDLE`.
    pub const INVALID_HANDLE: CuCode = CuCode(400);
    /// `CUDA_ERROR_NOT_FOUND`.
    pub const NOT_FOUND: CuCode = CuCode(500);
    /// `CUDA_ERROR_NOT_READY`.
    pub const NOT_READY: CuCode = CuCode(600);
    /// `CUDA_ERROR_ILLEGAL_ADDRESS`.
    pub const ILLEGAL_ADDRESS: CuCode = CuCode(700);
    /// `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`.
    pub const HOST_MEMORY_ALREADY_REGISTERED: CuCode = CuCode(712);
    /// `CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED`.
    pub const HOST_MEMORY_NOT_REGISTERED: CuCode = CuCode(713);
    /// `CUDA_ERROR_NOT_PERMITTED`.
    pub const NOT_PERMITTED: CuCode = CuCode(800);
    /// `CUDA_ERROR_NOT_SUPPORTED`.
    pub const NOT_SUPPORTED: CuCode = CuCode(801);
    /// `CUDA_ERROR_UNKNOWN`.
    pub const UNKNOWN: CuCode = CuCode(999);
    /// `CUDA_ERROR_ECC_UNCORRECTABLE`.
    pub const ECC_UNCORRECTABLE: CuCode = CuCode(214);
    /// `CUDA_ERROR_HARDWARE_STACK_ERROR`.
    pub const HARDWARE_STACK_ERROR: CuCode = CuCode(714);
    /// `CUDA_ERROR_ILLEGAL_INSTRUCTION`.
    pub const ILLEGAL_INSTRUCTION: CuCode = CuCode(715);
    /// `CUDA_ERROR_MISALIGNED_ADDRESS`.
    pub const MISALIGNED_ADDRESS: CuCode = CuCode(716);
    /// `CUDA_ERROR_INVALID_ADDRESS_SPACE`.
    pub const INVALID_ADDRESS_SPACE: CuCode = CuCode(717);
    /// `CUDA_ERROR_INVALID_PC`.
    pub const INVALID_PC: CuCode = CuCode(718);
    /// `CUDA_ERROR_LAUNCH_FAILED`.
    pub const LAUNCH_FAILED: CuCode = CuCode(719);
    /// `CUDA_ERROR_MPS_CONNECTION_FAILED`.
    pub const MPS_CONNECTION_FAILED: CuCode = CuCode(805);
    /// `CUDA_ERROR_MPS_RPC_FAILURE`.
    pub const MPS_RPC_FAILURE: CuCode = CuCode(806);
    /// `CUDA_ERROR_MPS_SERVER_NOT_READY`.
    pub const MPS_SERVER_NOT_READY: CuCode = CuCode(807);
    /// `CUDA_ERROR_MPS_CLIENT_TERMINATED`.
    pub const MPS_CLIENT_TERMINATED: CuCode = CuCode(810);

    /// Whether this code means the calling process's CUDA context is unusable from now on:
    /// a GPU fault (the "sticky" errors: illegal address, illegal instruction, ...), an
    /// uncorrectable ECC error, or the MPS server having dropped this client. Every later
    /// call in the process fails too; only a new process gets a working context.
    #[must_use]
    pub fn is_context_lost(self) -> bool {
        matches!(self.0, 214 | 700 | 714..=719 | 806 | 810)
    }

    /// The `CUDA_ERROR_*` name, or `CUDA_ERROR_<n>` for codes this table does not list.
    #[must_use]
    pub fn name(self) -> std::borrow::Cow<'static, str> {
        let known = match self.0 {
            1 => "CUDA_ERROR_INVALID_VALUE",
            2 => "CUDA_ERROR_OUT_OF_MEMORY",
            3 => "CUDA_ERROR_NOT_INITIALIZED",
            4 => "CUDA_ERROR_DEINITIALIZED",
            34 => "CUDA_ERROR_STUB_LIBRARY",
            46 => "CUDA_ERROR_DEVICE_UNAVAILABLE",
            100 => "CUDA_ERROR_NO_DEVICE",
            101 => "CUDA_ERROR_INVALID_DEVICE",
            200 => "CUDA_ERROR_INVALID_IMAGE",
            201 => "CUDA_ERROR_INVALID_CONTEXT",
            208 => "CUDA_ERROR_ALREADY_MAPPED",
            400 => "CUDA_ERROR_INVALID_HANDLE",
            500 => "CUDA_ERROR_NOT_FOUND",
            600 => "CUDA_ERROR_NOT_READY",
            214 => "CUDA_ERROR_ECC_UNCORRECTABLE",
            700 => "CUDA_ERROR_ILLEGAL_ADDRESS",
            714 => "CUDA_ERROR_HARDWARE_STACK_ERROR",
            715 => "CUDA_ERROR_ILLEGAL_INSTRUCTION",
            716 => "CUDA_ERROR_MISALIGNED_ADDRESS",
            717 => "CUDA_ERROR_INVALID_ADDRESS_SPACE",
            718 => "CUDA_ERROR_INVALID_PC",
            719 => "CUDA_ERROR_LAUNCH_FAILED",
            712 => "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
            713 => "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
            800 => "CUDA_ERROR_NOT_PERMITTED",
            801 => "CUDA_ERROR_NOT_SUPPORTED",
            805 => "CUDA_ERROR_MPS_CONNECTION_FAILED",
            806 => "CUDA_ERROR_MPS_RPC_FAILURE",
            807 => "CUDA_ERROR_MPS_SERVER_NOT_READY",
            808 => "CUDA_ERROR_MPS_MAX_CLIENTS_REACHED",
            809 => "CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED",
            810 => "CUDA_ERROR_MPS_CLIENT_TERMINATED",
            999 => "CUDA_ERROR_UNKNOWN",
            n => return std::borrow::Cow::Owned(format!("CUDA_ERROR_{n}")),
        };
        std::borrow::Cow::Borrowed(known)
    }
}

impl fmt::Display for CuCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name(), self.0)
    }
}

impl fmt::Debug for CuCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// What the errors that mean "no usable GPU here" add: how to run without one.
const NO_GPU_HINT: &str = "To run without a GPU, use the simulated driver: set \
     POOLIPC_DRIVER=sim (or POOLIPC_DRIVER=auto: the GPU where one is usable, else the \
     simulation), or in Rust open it with poolipc::driver::open_or(Choice::Auto).";

/// Why a driver call, or opening a driver, failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DriverError {
    /// A driver call returned an error code.
    #[error("{call} failed: {code}")]
    Call {
        /// The driver API function, e.g. `cuMemPoolExportPointer`.
        call: &'static str,
        /// What it returned.
        code: CuCode,
    },
    /// libcuda could not be loaded: no NVIDIA driver is installed, or it is not on the
    /// loader's path.
    #[error(
        "libcuda was not found (searched {searched}); is the NVIDIA driver installed? {hint}",
        hint = NO_GPU_HINT
    )]
    LibraryNotFound {
        /// The names tried.
        searched: String,
    },
    /// libcuda lacks a function poolipc needs: the driver is older than the API it was built for.
    #[error("libcuda has no symbol {symbol}: the driver is too old for poolipc")]
    MissingSymbol {
        /// The function that is missing.
        symbol: &'static str,
    },
    /// The driver loaded but reports no CUDA device.
    #[error(
        "no CUDA device is visible (check CUDA_VISIBLE_DEVICES and nvidia-smi). {hint}",
        hint = NO_GPU_HINT
    )]
    NoDevice,
    /// The device ordinal does not exist in this process.
    #[error("device {ordinal} does not exist: {count} device(s) visible")]
    DeviceOutOfRange {
        /// The ordinal asked for.
        ordinal: u32,
        /// How many devices this process sees.
        count: u32,
    },
    /// Running under WSL2, which has no interprocess events and no POSIX-FD pool export.
    #[error(
        "running under WSL2, which has no CUDA interprocess events and no POSIX-FD pool export; poolipc cannot share device memory here"
    )]
    Wsl2,
    /// The driver is older than pool IPC needs.
    #[error(
        "the CUDA driver reports API version {found}, but poolipc needs at least {required} (memory pool IPC)"
    )]
    DriverTooOld {
        /// What `cuDriverGetVersion` returned, e.g. 12080 for 12.8.
        found: i32,
        /// What we need.
        required: i32,
    },
    /// The device cannot do something poolipc needs.
    #[error("device {ordinal} does not support {what}")]
    Unsupported {
        /// The device ordinal.
        ordinal: u32,
        /// What it lacks.
        what: &'static str,
    },
    /// An argument could not be represented for the driver (a size over `usize`, ...).
    #[error("invalid argument to {call}: {reason}")]
    InvalidArgument {
        /// The call it was meant for.
        call: &'static str,
        /// What was wrong with it.
        reason: String,
    },
    /// A pointer import over the 128-chunk limit, refused by the simulation with its crash
    /// emulation switched off (`SimConfig::import_crash`). Real libcuda kills the process.
    #[error(
        "cuMemPoolImportPointer: the allocation spans {chunks} chunks of 32 MiB, over the limit of {limit}"
    )]
    ImportOverLimit {
        /// The 32 MiB chunks the allocation touches.
        chunks: u64,
        /// The most that import survives.
        limit: u64,
    },
    /// A range of a [`SharedHostBuffer`](crate::host::SharedHostBuffer) past its end.
    #[error("{call}: {bytes} bytes at offset {offset} run past the buffer's {len} bytes")]
    OutOfBounds {
        /// The access or copy refused.
        call: &'static str,
        /// Where the range starts.
        offset: u64,
        /// Its length.
        bytes: u64,
        /// The buffer's length.
        len: u64,
    },
    /// An operating system call the driver layer made failed.
    #[error("{call} failed: {source}")]
    Os {
        /// The system call.
        call: &'static str,
        /// The errno.
        #[source]
        source: std::io::Error,
    },
}

impl DriverError {
    /// The CUresult of a failed driver call, if this is one.
    #[must_use]
    pub fn code(&self) -> Option<CuCode> {
        match self {
            DriverError::Call { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// Whether this error says the process's CUDA context is lost (see
    /// [`CuCode::is_context_lost`]).
    #[must_use]
    pub fn is_context_lost(&self) -> bool {
        self.code().is_some_and(CuCode::is_context_lost)
    }

    /// Whether this is `call` failing with `code`.
    #[must_use]
    pub fn is_call(&self, call: &str, code: CuCode) -> bool {
        matches!(self, DriverError::Call { call: c, code: k } if *c == call && *k == code)
    }
}

/// The result of a driver call.
pub type Result<T, E = DriverError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn call_error_names_the_call_and_the_code() {
        let e = DriverError::Call {
            call: "cuMemPoolExportPointer",
            code: CuCode::INVALID_VALUE,
        };
        assert_eq!(
            e.to_string(),
            "cuMemPoolExportPointer failed: CUDA_ERROR_INVALID_VALUE (1)"
        );
        assert_eq!(e.code(), Some(CuCode::INVALID_VALUE));
        assert!(e.is_call("cuMemPoolExportPointer", CuCode::INVALID_VALUE));
        assert!(!e.is_call("cuMemPoolImportPointer", CuCode::INVALID_VALUE));
    }

    #[test]
    fn unknown_codes_still_have_a_name() {
        assert_eq!(CuCode(12345).name(), "CUDA_ERROR_12345");
        assert_eq!(CuCode::NOT_READY.to_string(), "CUDA_ERROR_NOT_READY (600)");
    }

    #[test]
    fn platform_errors_say_what_to_do() {
        assert!(DriverError::Wsl2.to_string().contains("WSL2"));
        let old = DriverError::DriverTooOld {
            found: 11020,
            required: 12000,
        };
        assert!(old.to_string().contains("11020") && old.to_string().contains("12000"));
        assert!(
            DriverError::NoDevice
                .to_string()
                .contains("CUDA_VISIBLE_DEVICES")
        );
    }

    #[test]
    fn no_usable_gpu_says_how_to_run_on_the_simulated_driver() {
        let missing = DriverError::LibraryNotFound {
            searched: "libcuda.so.1".into(),
        };
        for e in [missing, DriverError::NoDevice] {
            let text = e.to_string();
            assert!(text.contains("POOLIPC_DRIVER=sim"), "{text}");
            assert!(text.contains("open_or(Choice::Auto)"), "{text}");
        }
    }
}
