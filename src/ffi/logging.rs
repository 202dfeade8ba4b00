//! The host log callback: routes the library's log lines (`crate::log`) to a C function.

use std::ffi::{CString, c_char, c_void};

use crate::ffi::status::{dsv4_status, ffi_boundary, invalid};
use crate::log::{self, Level};

/// Log level: errors only.
pub const DSV4_LOG_ERROR: i32 = 0;
/// Log level: warnings and errors (the default).
pub const DSV4_LOG_WARN: i32 = 1;
/// Log level: informational messages and above.
pub const DSV4_LOG_INFO: i32 = 2;
/// Log level: everything.
pub const DSV4_LOG_DEBUG: i32 = 3;

const _: () = {
    assert!(DSV4_LOG_ERROR == Level::Error as i32);
    assert!(DSV4_LOG_WARN == Level::Warn as i32);
    assert!(DSV4_LOG_INFO == Level::Info as i32);
    assert!(DSV4_LOG_DEBUG == Level::Debug as i32);
};

/// A host log sink: `level` is a DSV4_LOG_* value, `message` a NUL-terminated UTF-8 line
/// (without a trailing newline) valid only during the call, `user` the pointer given to
/// dsv4_set_log_callback. May be called from any thread that is inside a dsv4 call,
/// including worker threads, so it must be thread-safe. It must return normally (no C++
/// exception, no longjmp) and must not call dsv4_set_log_callback.
pub type dsv4_log_callback =
    Option<unsafe extern "C" fn(level: i32, message: *const c_char, user: *mut c_void)>;

/// The host's `user` pointer; the host promises it may be used from any thread.
struct UserPtr(*mut c_void);
// SAFETY: documented contract of dsv4_set_log_callback: `user` is shared with every thread.
unsafe impl Send for UserPtr {}
// SAFETY: as above.
unsafe impl Sync for UserPtr {}

fn level_from_i32(v: i32) -> Option<Level> {
    Some(match v {
        DSV4_LOG_ERROR => Level::Error,
        DSV4_LOG_WARN => Level::Warn,
        DSV4_LOG_INFO => Level::Info,
        DSV4_LOG_DEBUG => Level::Debug,
        _ => return None,
    })
}

/// Installs the process-wide log sink: every message at `max_level` or more severe goes
/// to `callback(level, message, user)`. `callback` = NULL restores the default sink
/// (stderr) with the given `max_level`. `user` is passed through untouched and must stay
/// valid until the callback is replaced. Thread-safe; affects every engine.
///
/// Errors: INVALID_ARGUMENT (`max_level` not a DSV4_LOG_* value; the previous sink stays).
///
/// # Safety
/// `callback`, if not NULL, must be callable as documented for dsv4_log_callback.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dsv4_set_log_callback(
    callback: dsv4_log_callback,
    user: *mut c_void,
    max_level: i32,
) -> dsv4_status {
    ffi_boundary("dsv4_set_log_callback", || {
        let level = level_from_i32(max_level).ok_or_else(|| {
            invalid(format!(
                "`max_level` = {max_level} is not a DSV4_LOG_* level (ERROR = 0, WARN = 1, INFO = 2, DEBUG = 3)"
            ))
        })?;
        let sink: Option<log::Sink> = callback.map(|cb| {
            let user = UserPtr(user);
            Box::new(move |lvl: Level, msg: &str| {
                let text = CString::new(msg.replace('\0', "\\0")).unwrap_or_default();
                let u = &user;
                // SAFETY: the host promised `cb` is callable with these arguments.
                unsafe { cb(lvl as i32, text.as_ptr(), u.0) };
            }) as log::Sink
        });
        log::set_sink(sink, level);
        Ok(())
    })
}
