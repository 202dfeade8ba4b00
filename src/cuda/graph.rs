//! CUDA graph capture of engine calls, as a host does it: begin a GLOBAL-mode capture on the
//! host's stream, run calls (dsv4_forward), end the capture, instantiate, replay. For tests
//! and tools standing in for a host; the engine itself never captures.
//!
//! GLOBAL mode makes the driver reject, for the whole process, any call that would be unsafe
//! during a capture (allocation, a synchronizing copy, a sync): a forward that did one would
//! fail the capture instead of producing a graph that silently differs from eager.

use super::check;
use super::stream::BorrowedStream;
use crate::error::{Error, Result, Status};
use cudarc::driver::sys;

/// An instantiated graph; replays with [`Graph::launch`]. The context must be current when it
/// is dropped.
pub struct Graph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
}

impl Graph {
    /// Captures everything `body` enqueues on `stream` (a non-default stream) into a graph.
    /// If `body` fails, the capture is ended and discarded and its error returned.
    pub fn capture(stream: BorrowedStream, body: impl FnOnce() -> Result<()>) -> Result<Graph> {
        if stream.is_legacy_default() {
            return Err(Error::new(
                Status::InvalidArgument,
                "graph capture needs a non-default stream",
            ));
        }
        // SAFETY: a valid stream in the current context.
        check("cuStreamBeginCapture_v2", unsafe {
            sys::cuStreamBeginCapture_v2(
                stream.raw(),
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
            )
        })?;
        let body_result = body();
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: ends the capture begun above (always, so the stream leaves capture mode).
        let end = check("cuStreamEndCapture", unsafe {
            sys::cuStreamEndCapture(stream.raw(), &mut graph)
        });
        if let Err(e) = body_result.and(end) {
            if !graph.is_null() {
                // SAFETY: the graph came from the capture and is not used elsewhere.
                unsafe { sys::cuGraphDestroy(graph) };
            }
            return Err(e);
        }
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: `graph` is a valid captured graph.
        if let Err(e) = check("cuGraphInstantiateWithFlags", unsafe {
            sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0)
        }) {
            // SAFETY: as above.
            unsafe { sys::cuGraphDestroy(graph) };
            return Err(e);
        }
        Ok(Graph { graph, exec })
    }

    /// Enqueues one replay on `stream` (does not wait).
    pub fn launch(&self, stream: BorrowedStream) -> Result<()> {
        // SAFETY: `exec` is a live instantiated graph.
        check("cuGraphLaunch", unsafe {
            sys::cuGraphLaunch(self.exec, stream.raw())
        })
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: both handles are owned by this value and destroyed once.
        unsafe {
            sys::cuGraphExecDestroy(self.exec);
            sys::cuGraphDestroy(self.graph);
        }
    }
}
