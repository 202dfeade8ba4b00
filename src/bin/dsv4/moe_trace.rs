//! `dsv4 bench moe --trace DIR`: the event log of the fused decode kernels' `FMOE_TRACE` build
//! (kernels/fast_moe_gemm.cu: what each block did and when, in %globaltimer nanoseconds), read
//! back after one traced layer call and written as one JSON file a case for
//! scripts/fmoe-trace.py. The log exists only in a build with `--defines FMOE_TRACE=1`; without
//! it the bench says so instead of tracing.

use std::path::Path;

use crate::bench_util::e;
use dsv4::cuda::arena::{self, DevicePtr};
use dsv4::cuda::kernels::fast_moe_gemm;
use dsv4::cuda::registry::Registry;
use dsv4::cuda::stream::BorrowedStream;

/// The kernel family's log: its event count and its events (two u64 each).
pub struct TraceLog {
    count: DevicePtr,
    events: DevicePtr,
}

impl TraceLog {
    /// The log of the loaded fast_moe_gemm module, or an error naming the define it needs.
    pub fn find(reg: &Registry) -> Result<TraceLog, String> {
        let family = fast_moe_gemm::SOURCE.family;
        let get = |name: &str| -> Result<DevicePtr, String> {
            match reg.global(family, name).map_err(e)? {
                // SAFETY: the module's own variable, alive as long as the registry.
                Some((addr, bytes)) => Ok(unsafe { DevicePtr::from_raw(addr, bytes) }),
                None => Err(format!(
                    "--trace needs the kernels' trace build: add --defines FMOE_TRACE=1 \
                     ({family} has no `{name}`)"
                )),
            }
        };
        Ok(TraceLog {
            count: get("fmoe_trace_n")?,
            events: get("fmoe_trace_log")?,
        })
    }

    /// Empties the log (before the launch to trace; the stream is synchronised).
    pub fn reset(&self, s: BorrowedStream) -> Result<(), String> {
        arena::copy_to_device_sync(self.count, &[0u32], s).map_err(e)
    }

    /// Writes the events logged since [`TraceLog::reset`] to `path` as JSON: the case's labels,
    /// the count (also what the log could not hold) and `[t_ns, block, sm, kind, arg]` rows
    /// sorted by time. The stream is synchronised.
    pub fn write(&self, s: BorrowedStream, path: &Path, labels: &str) -> Result<(), String> {
        let mut n = [0u32];
        arena::copy_to_host_sync(&mut n, self.count, s).map_err(e)?;
        let cap = self.events.bytes() / 16;
        let kept = (n[0] as usize).min(cap);
        let mut raw = vec![0u64; 2 * cap];
        arena::copy_to_host_sync(&mut raw, self.events, s).map_err(e)?;
        let mut rows: Vec<[i64; 5]> = raw[..2 * kept]
            .chunks_exact(2)
            .map(|ev| {
                let w = ev[1];
                [
                    ev[0] as i64,
                    (w >> 48) as i64,
                    ((w >> 40) & 0xff) as i64,
                    ((w >> 32) & 0xff) as i64,
                    (w as u32) as i32 as i64,
                ]
            })
            .collect();
        rows.sort_unstable();
        let body: Vec<String> = rows
            .iter()
            .map(|r| format!("[{},{},{},{},{}]", r[0], r[1], r[2], r[3], r[4]))
            .collect();
        let json = format!(
            "{{{labels}, \"events_logged\": {}, \"capacity\": {cap}, \"fields\": [\"t_ns\", \"block\", \"sm\", \"kind\", \"arg\"], \"events\": [\n{}\n]}}\n",
            n[0],
            body.join(",\n")
        );
        std::fs::write(path, json).map_err(|x| format!("{}: {x}", path.display()))
    }
}
