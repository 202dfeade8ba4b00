//! `dsv4 bench moe --trace DIR`: the event logs of the fast MoE kernels' trace builds, read back
//! after one traced layer call and written as one JSON file a case: the fused decode kernels'
//! `FMOE_TRACE` build (kernels/fast_moe_gemm.cu; scripts/fmoe-trace.py reads it) and the prefill
//! GEMMs' `FMW_TRACE` build (kernels/fast_moe_wide.cu, both tile builds; scripts/fmw-trace.py):
//! what each block did and when, in %globaltimer nanoseconds. A log exists only in a build with
//! its define (`--defines FMOE_TRACE=1` / `FMW_TRACE=1`); without it the bench says so instead
//! of tracing.

use std::path::Path;

use crate::bench_util::e;
use dsv4::cuda::arena::{self, DevicePtr};
use dsv4::cuda::kernels::fast_moe_gemm::{self, GemmPath};
use dsv4::cuda::kernels::fast_moe_wide;
use dsv4::cuda::registry::Registry;
use dsv4::cuda::stream::BorrowedStream;

/// One kernel family's log: its event count and its events (two u64 each).
pub struct TraceLog {
    count: DevicePtr,
    events: DevicePtr,
    /// The case files' name prefix: `fmoe_trace` or `fmw_trace`.
    pub prefix: &'static str,
}

/// The logs of the families the bench loaded with their trace define.
pub struct TraceLogs {
    /// fast_moe_gemm's (the decode paths).
    decode: Option<TraceLog>,
    /// fast_moe_wide's and fast_moe_wide_narrow's (the prefill path's two tile builds).
    wide: Option<TraceLog>,
    narrow: Option<TraceLog>,
}

impl TraceLogs {
    /// Every log the loaded modules have, or an error naming the defines when none has one.
    pub fn find(reg: &Registry) -> Result<TraceLogs, String> {
        let logs = TraceLogs {
            decode: TraceLog::of(reg, fast_moe_gemm::SOURCE.family, "fmoe_trace")?,
            wide: TraceLog::of(reg, fast_moe_wide::SOURCE.family, "fmw_trace")?,
            narrow: TraceLog::of(reg, fast_moe_wide::NARROW_SOURCE.family, "fmw_trace")?,
        };
        if logs.decode.is_none() && logs.wide.is_none() && logs.narrow.is_none() {
            return Err(
                "--trace needs a kernel trace build: add --defines FMOE_TRACE=1 (the decode \
                 paths) or FMW_TRACE=1 (the prefill path)"
                    .into(),
            );
        }
        Ok(logs)
    }

    /// The log of the kernels a case of `t` tokens on `path` runs, or an error naming its define.
    pub fn for_case(&self, path: GemmPath, t: usize) -> Result<&TraceLog, String> {
        let (log, define) = if path == GemmPath::Prefill {
            (
                if fast_moe_wide::narrow_tiles(t) {
                    &self.narrow
                } else {
                    &self.wide
                },
                "FMW_TRACE=1",
            )
        } else {
            (&self.decode, "FMOE_TRACE=1")
        };
        log.as_ref().ok_or_else(|| {
            format!(
                "--trace: B = {t} runs kernels built without their trace: add --defines {define}"
            )
        })
    }
}

impl TraceLog {
    /// The log of `family`'s loaded module (its `{prefix}_n` and `{prefix}_log`), or `None`
    /// where the family was built without its trace define.
    fn of(reg: &Registry, family: &str, prefix: &'static str) -> Result<Option<TraceLog>, String> {
        let get = |name: String| -> Result<Option<DevicePtr>, String> {
            Ok(reg
                .global(family, &name)
                .map_err(e)?
                // SAFETY: the module's own variable, alive as long as the registry.
                .map(|(addr, bytes)| unsafe { DevicePtr::from_raw(addr, bytes) }))
        };
        Ok(
            match (get(format!("{prefix}_n"))?, get(format!("{prefix}_log"))?) {
                (Some(count), Some(events)) => Some(TraceLog {
                    count,
                    events,
                    prefix,
                }),
                _ => None,
            },
        )
    }

    /// Empties the log (before the launch to trace; the stream is synchronised): the count and
    /// every event, since a family may log at slots of its own choosing (FMW_TRACE,
    /// kernels/fast_moe_common.cuh `moe_trace_event_at`) and [`TraceLog::write`] keeps the
    /// events whose time is set.
    pub fn reset(&self, s: BorrowedStream) -> Result<(), String> {
        // (The events by a memset on the stream, which the count's synchronous copy then waits for.)
        arena::memset_async(self.events, 0, s).map_err(e)?;
        arena::copy_to_device_sync(self.count, &[0u32], s).map_err(e)
    }

    /// Writes the events logged since [`TraceLog::reset`] to `path` as JSON: the case's labels,
    /// the count (more than the rows where the log could not hold them all) and `[t_ns, block,
    /// sm, kind, arg]` rows sorted by time: the slots whose time is set. The stream is
    /// synchronised.
    pub fn write(&self, s: BorrowedStream, path: &Path, labels: &str) -> Result<(), String> {
        let mut n = [0u32];
        arena::copy_to_host_sync(&mut n, self.count, s).map_err(e)?;
        let cap = self.events.bytes() / 16;
        let mut raw = vec![0u64; 2 * cap];
        arena::copy_to_host_sync(&mut raw, self.events, s).map_err(e)?;
        let mut rows: Vec<[i64; 5]> = raw
            .chunks_exact(2)
            .filter(|ev| ev[0] != 0)
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
