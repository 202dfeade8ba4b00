//! Error type shared by every layer below `ffi/`.
//!
//! An [`Error`] carries the status code the C ABI returns and a message that names the
//! argument, field, tensor or file at fault. `ffi/` turns it into `dsv4_status` plus the
//! thread-local `dsv4_last_error` text; nothing here knows about C.

use std::fmt;

/// Status codes, numerically identical to `dsv4_status` in the C header.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Ok = 0,
    /// An argument is out of range or inconsistent (bad enum, negative count, ...).
    InvalidArgument = 1,
    /// A required pointer argument was NULL.
    NullPointer = 2,
    /// The call is not allowed in the engine's current lifecycle state.
    State = 3,
    /// config.json is missing, malformed, or violates a model rule.
    Config = 4,
    /// A file could not be opened, read or mapped.
    Io = 5,
    /// A checkpoint file is malformed (bad safetensors header, truncated data, bad index).
    Format = 6,
    /// A tensor is unknown, missing, duplicated, or has the wrong dtype or shape.
    Tensor = 7,
    /// A batch exceeds a capacity fixed at create (tokens, sequence length, slots).
    Capacity = 8,
    /// CUDA was requested but no driver/device is available.
    NoDevice = 9,
    /// A CUDA driver/runtime call failed.
    Cuda = 10,
    /// The request is valid but not supported by this build or backend.
    Unsupported = 11,
    /// A bug in dsv4 (including a caught panic).
    Internal = 12,
    /// Host or device memory for the engine could not be allocated (create / load).
    OutOfMemory = 13,
}

impl Status {
    pub fn name(self) -> &'static str {
        match self {
            Status::Ok => "OK",
            Status::InvalidArgument => "INVALID_ARGUMENT",
            Status::NullPointer => "NULL_POINTER",
            Status::State => "STATE",
            Status::Config => "CONFIG",
            Status::Io => "IO",
            Status::Format => "FORMAT",
            Status::Tensor => "TENSOR",
            Status::Capacity => "CAPACITY",
            Status::NoDevice => "NO_DEVICE",
            Status::Cuda => "CUDA",
            Status::Unsupported => "UNSUPPORTED",
            Status::Internal => "INTERNAL",
            Status::OutOfMemory => "OUT_OF_MEMORY",
        }
    }
}

/// A failure with its status and a human-readable message naming the culprit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub status: Status,
    pub message: String,
}

impl Error {
    pub fn new(status: Status, message: impl Into<String>) -> Self {
        Error {
            status,
            message: message.into(),
        }
    }

    /// Prefixes the message with context ("loading model.safetensors: ...").
    pub fn context(mut self, what: impl fmt::Display) -> Self {
        self.message = format!("{what}: {}", self.message);
        self
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.message, self.status.name())
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

/// `bail!(Status, "fmt", args)` returns early with an [`Error`].
#[macro_export]
macro_rules! bail {
    ($status:ident, $($arg:tt)*) => {
        return Err($crate::error::Error::new($crate::error::Status::$status, format!($($arg)*)))
    };
}

/// `err!(Status, "fmt", args)` builds an [`Error`].
#[macro_export]
macro_rules! err {
    ($status:ident, $($arg:tt)*) => {
        $crate::error::Error::new($crate::error::Status::$status, format!($($arg)*))
    };
}
