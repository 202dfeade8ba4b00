//! Status codes, the thread-local last error, and the one panic boundary every export runs in.
//!
//! Every status-returning export is `ffi_boundary(name, || { ... })`: the closure returns a
//! Rust [`Result`]; an `Err` becomes its status plus the thread-local message, a panic
//! becomes `DSV4_STATUS_INTERNAL` plus the panic text. Nothing here may itself panic across
//! the boundary.

use std::any::Any;
use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::error::{Error, Result, Status};

/// Result code of every fallible dsv4 call: `DSV4_STATUS_OK` (0) or one of the
/// `DSV4_STATUS_*` failures. On failure, `dsv4_last_error()` names the argument, field,
/// tensor or file at fault.
pub type dsv4_status = i32;

/// Success.
pub const DSV4_STATUS_OK: dsv4_status = 0;
/// An argument is out of range or inconsistent (bad enum value, negative count, struct_size
/// too small, count mismatch, ...).
pub const DSV4_STATUS_INVALID_ARGUMENT: dsv4_status = 1;
/// A required pointer argument (or a pointer field with a nonzero count) was NULL.
pub const DSV4_STATUS_NULL_POINTER: dsv4_status = 2;
/// The call is not allowed in the engine's current lifecycle phase
/// (e.g. dsv4_forward before dsv4_finalize, dsv4_load after it).
pub const DSV4_STATUS_STATE: dsv4_status = 3;
/// config.json is missing, malformed, or violates a model rule (the message names the field).
pub const DSV4_STATUS_CONFIG: dsv4_status = 4;
/// A file could not be opened, read or mapped.
pub const DSV4_STATUS_IO: dsv4_status = 5;
/// A checkpoint file is malformed (bad safetensors header, truncated data, bad index).
pub const DSV4_STATUS_FORMAT: dsv4_status = 6;
/// A tensor is unknown, missing, duplicated, or has the wrong dtype or shape.
pub const DSV4_STATUS_TENSOR: dsv4_status = 7;
/// A batch exceeds a capacity fixed at create (max_num_tokens, max_seq_len, max_num_seqs),
/// or memory for a create-time buffer could not be allocated.
pub const DSV4_STATUS_CAPACITY: dsv4_status = 8;
/// CUDA was requested but no driver or device is available.
pub const DSV4_STATUS_NO_DEVICE: dsv4_status = 9;
/// A CUDA driver/runtime call failed.
pub const DSV4_STATUS_CUDA: dsv4_status = 10;
/// The request is valid but not supported by this build or backend
/// (e.g. DSV4_MEMORY_DEVICE on the CPU backend).
pub const DSV4_STATUS_UNSUPPORTED: dsv4_status = 11;
/// A bug in dsv4, including a caught panic. An engine that reported INTERNAL from a call
/// that modifies it is unusable afterwards (every later modifying call on it returns
/// INTERNAL); destroy it.
pub const DSV4_STATUS_INTERNAL: dsv4_status = 12;
/// Since ABI 1.3. The engine's memory could not be allocated: at dsv4_create, its buffers do
/// not fit in the free device memory or an allocation failed (host or device); at dsv4_load,
/// a host buffer. Lower the capacities (max_num_seqs, max_num_tokens, max_seq_len) or free
/// memory. (CAPACITY is a batch beyond the capacities fixed at create: send a smaller batch.)
pub const DSV4_STATUS_OUT_OF_MEMORY: dsv4_status = 13;

// The ABI values are the Rust `Status` discriminants; a change to either breaks the build.
const _: () = {
    assert!(DSV4_STATUS_OK == Status::Ok as i32);
    assert!(DSV4_STATUS_INVALID_ARGUMENT == Status::InvalidArgument as i32);
    assert!(DSV4_STATUS_NULL_POINTER == Status::NullPointer as i32);
    assert!(DSV4_STATUS_STATE == Status::State as i32);
    assert!(DSV4_STATUS_CONFIG == Status::Config as i32);
    assert!(DSV4_STATUS_IO == Status::Io as i32);
    assert!(DSV4_STATUS_FORMAT == Status::Format as i32);
    assert!(DSV4_STATUS_TENSOR == Status::Tensor as i32);
    assert!(DSV4_STATUS_CAPACITY == Status::Capacity as i32);
    assert!(DSV4_STATUS_NO_DEVICE == Status::NoDevice as i32);
    assert!(DSV4_STATUS_CUDA == Status::Cuda as i32);
    assert!(DSV4_STATUS_UNSUPPORTED == Status::Unsupported as i32);
    assert!(DSV4_STATUS_INTERNAL == Status::Internal as i32);
    assert!(DSV4_STATUS_OUT_OF_MEMORY == Status::OutOfMemory as i32);
};

/// Every status value, for tests and `dsv4_status_name`.
pub(crate) const ALL_STATUSES: [Status; 14] = [
    Status::Ok,
    Status::InvalidArgument,
    Status::NullPointer,
    Status::State,
    Status::Config,
    Status::Io,
    Status::Format,
    Status::Tensor,
    Status::Capacity,
    Status::NoDevice,
    Status::Cuda,
    Status::Unsupported,
    Status::Internal,
    Status::OutOfMemory,
];

/// Static NUL-terminated name of a status ("OK", "INVALID_ARGUMENT", ...; "UNKNOWN").
pub(crate) fn status_cname(s: dsv4_status) -> &'static CStr {
    let Some(st) = ALL_STATUSES.iter().find(|x| **x as i32 == s) else {
        return c"UNKNOWN";
    };
    match st {
        Status::Ok => c"OK",
        Status::InvalidArgument => c"INVALID_ARGUMENT",
        Status::NullPointer => c"NULL_POINTER",
        Status::State => c"STATE",
        Status::Config => c"CONFIG",
        Status::Io => c"IO",
        Status::Format => c"FORMAT",
        Status::Tensor => c"TENSOR",
        Status::Capacity => c"CAPACITY",
        Status::NoDevice => c"NO_DEVICE",
        Status::Cuda => c"CUDA",
        Status::Unsupported => c"UNSUPPORTED",
        Status::Internal => c"INTERNAL",
        Status::OutOfMemory => c"OUT_OF_MEMORY",
    }
}

thread_local! {
    /// Message of the most recent status-returning call on this thread ("" if it succeeded).
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Replaces this thread's last-error text. Interior NULs are escaped, never truncating.
pub(crate) fn set_last_error(msg: &str) {
    let c = CString::new(msg.replace('\0', "\\0")).unwrap_or_default();
    // try_with: during thread teardown the slot may be gone; losing the text is fine then.
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = c);
}

pub(crate) fn clear_last_error() {
    let _ = LAST_ERROR.try_with(|e| {
        if !e.borrow().is_empty() {
            *e.borrow_mut() = CString::default();
        }
    });
}

/// Pointer to this thread's last-error text; valid until the next dsv4 call on this thread.
pub(crate) fn last_error_ptr() -> *const c_char {
    LAST_ERROR
        .try_with(|e| e.borrow().as_ptr())
        .unwrap_or(c"".as_ptr())
}

/// Text of a panic payload (`panic!("...")` gives a `&str` or a `String`).
pub(crate) fn panic_message(p: &(dyn Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-string payload".to_owned()
    }
}

/// Runs the body of export `func`: clears the last error, catches panics, and turns the
/// result into a status. Error messages are prefixed with `func` unless they already
/// start with it.
pub(crate) fn ffi_boundary<F>(func: &str, body: F) -> dsv4_status
where
    F: FnOnce() -> Result<()>,
{
    clear_last_error();
    let outcome = catch_unwind(AssertUnwindSafe(body));
    let err = match outcome {
        Ok(Ok(())) => return DSV4_STATUS_OK,
        Ok(Err(e)) => e,
        Err(p) => Error::new(
            Status::Internal,
            format!("internal error (panic): {}", panic_message(&*p)),
        ),
    };
    let msg = if err.message.starts_with(func) {
        err.message
    } else {
        format!("{func}: {}", err.message)
    };
    set_last_error(&msg);
    err.status as dsv4_status
}

/// Runs `body` for an export that cannot report a status; a panic is logged, and `fallback`
/// is returned instead.
pub(crate) fn infallible<T>(func: &str, fallback: T, body: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(v) => v,
        Err(p) => {
            let msg = format!("{func}: internal error (panic): {}", panic_message(&*p));
            // Logging may itself fail (a poisoned sink); never let that escape.
            let _ = catch_unwind(|| crate::log::log(crate::log::Level::Error, &msg));
            fallback
        }
    }
}

/// `NULL_POINTER` error naming the argument or field (`"batch->token_ids"`).
pub(crate) fn null_error(what: &str) -> Error {
    Error::new(Status::NullPointer, format!("`{what}` is NULL"))
}

/// Shared reference behind a pointer argument, or a `NULL_POINTER` error naming it.
///
/// # Safety
/// A non-NULL `p` must point to a valid `T` that outlives `'a`.
pub(crate) unsafe fn non_null<'a, T>(p: *const T, what: &str) -> Result<&'a T> {
    // SAFETY: forwarded to the caller.
    unsafe { p.as_ref() }.ok_or_else(|| null_error(what))
}

/// Mutable reference behind a pointer argument, or a `NULL_POINTER` error naming it.
///
/// # Safety
/// A non-NULL `p` must point to a valid `T`, not aliased for `'a`.
pub(crate) unsafe fn non_null_mut<'a, T>(p: *mut T, what: &str) -> Result<&'a mut T> {
    // SAFETY: forwarded to the caller.
    unsafe { p.as_mut() }.ok_or_else(|| null_error(what))
}

/// `INVALID_ARGUMENT` error.
pub(crate) fn invalid(msg: impl Into<String>) -> Error {
    Error::new(Status::InvalidArgument, msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last() -> String {
        // SAFETY: the pointer is a NUL-terminated thread-local string.
        unsafe { CStr::from_ptr(last_error_ptr()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn panic_becomes_internal_with_message() {
        let s = ffi_boundary("dsv4_test", || panic!("boom {}", 42));
        assert_eq!(s, DSV4_STATUS_INTERNAL);
        let m = last();
        assert!(m.starts_with("dsv4_test: ") && m.contains("boom 42"), "{m}");
        // A later successful call clears the message.
        assert_eq!(ffi_boundary("dsv4_test", || Ok(())), DSV4_STATUS_OK);
        assert_eq!(last(), "");
    }

    #[test]
    fn error_keeps_status_and_prefix_once() {
        let s = ffi_boundary("dsv4_load", || {
            Err(Error::new(Status::State, "dsv4_load is not allowed"))
        });
        assert_eq!(s, DSV4_STATUS_STATE);
        assert_eq!(last(), "dsv4_load is not allowed");
        let s = ffi_boundary("dsv4_load", || Err(null_error("source")));
        assert_eq!(s, DSV4_STATUS_NULL_POINTER);
        assert_eq!(last(), "dsv4_load: `source` is NULL");
    }

    #[test]
    fn interior_nul_is_escaped() {
        set_last_error("a\0b");
        assert_eq!(last(), "a\\0b");
    }

    #[test]
    fn names_cover_every_status() {
        for s in ALL_STATUSES {
            assert_eq!(status_cname(s as i32).to_str().unwrap(), s.name());
        }
        assert_eq!(status_cname(99).to_str().unwrap(), "UNKNOWN");
    }
}
