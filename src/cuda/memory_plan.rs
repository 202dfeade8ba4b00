//! The CUDA backend's memory plan: every device buffer declared ONCE (name, kind, element
//! type, shape), laid out in the single arena at create. The arena layout, the
//! `dsv4_get_info` spans (by kind) and the derived tensors `dsv4_weight_info` lists (with
//! their element type and shape) all come from these declarations.
//!
//! Buffers are declared kind by kind (weights, derived, state, workspace), so each kind is
//! one contiguous span of the arena.

use crate::backend::DerivedTensor;
pub use crate::backend::Elem;
use crate::cuda::arena::{Arena, ArenaPlan, DevicePtr, RegionId};
use crate::error::{Error, Result, Status};

/// What a buffer holds, which decides its span in `dsv4_get_info`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BufferKind {
    /// Weights in their stored format (codes and block scales).
    Weights,
    /// Built from the weights by finalize / refit.
    Derived,
    /// Per-slot decode state (and the sticky device error record).
    State,
    /// Per-forward scratch of the kernel set.
    Workspace,
}

/// One declared buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BufferDecl {
    /// Region name (`weight:`, `scale:`, `derived:`, `state:` or `workspace:` prefixed).
    pub name: String,
    pub kind: BufferKind,
    pub elem: Elem,
    pub shape: Vec<usize>,
}

impl BufferDecl {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes reserved: at least one element, so an empty buffer still has an address.
    pub fn bytes(&self) -> usize {
        self.numel().max(1) * self.elem.size()
    }
}

/// Alignment of every buffer (256 B: TMA / vector-load friendly, and what cuMemAlloc gives).
const ALIGN: usize = 256;

/// The declarations of an engine, in arena order.
#[derive(Default)]
pub struct MemoryPlan {
    arena: ArenaPlan,
    decls: Vec<BufferDecl>,
}

impl MemoryPlan {
    pub fn new() -> MemoryPlan {
        MemoryPlan::default()
    }

    /// Declares a buffer; kinds must come in order (weights, derived, state, workspace) so
    /// that each is one span.
    pub fn declare(
        &mut self,
        kind: BufferKind,
        name: impl Into<String>,
        elem: Elem,
        shape: &[usize],
    ) -> Result<RegionId> {
        let decl = BufferDecl {
            name: name.into(),
            kind,
            elem,
            shape: shape.to_vec(),
        };
        if let Some(last) = self.decls.last()
            && (last.kind as u8) > (kind as u8)
        {
            return Err(Error::new(
                Status::Internal,
                format!(
                    "memory plan: `{}` ({kind:?}) declared after a {:?} buffer",
                    decl.name, last.kind
                ),
            ));
        }
        let id = self.arena.reserve(decl.name.clone(), decl.bytes(), ALIGN)?;
        self.decls.push(decl);
        Ok(id)
    }

    /// Bytes the single allocation needs.
    pub fn total_bytes(&self) -> usize {
        self.arena.total_bytes()
    }

    pub fn decls(&self) -> &[BufferDecl] {
        &self.decls
    }

    /// Bytes declared of one kind.
    pub fn kind_bytes(&self, kind: BufferKind) -> usize {
        self.decls
            .iter()
            .filter(|d| d.kind == kind)
            .map(BufferDecl::bytes)
            .sum()
    }

    pub fn arena_plan(&self) -> &ArenaPlan {
        &self.arena
    }

    /// Bytes of the span covering every buffer of `kind` once allocated (padding between
    /// them included): what [`Buffers::span`] will report.
    pub fn kind_span(&self, kind: BufferKind) -> u64 {
        let (mut lo, mut hi) = (usize::MAX, 0);
        for (d, (start, bytes)) in self.decls.iter().zip(self.arena.offsets()) {
            if d.kind == kind {
                lo = lo.min(start);
                hi = hi.max(start + bytes);
            }
        }
        if lo == usize::MAX {
            0
        } else {
            (hi - lo) as u64
        }
    }
}

/// The allocated plan: the arena and what each of its regions is.
pub struct Buffers {
    pub arena: Arena,
    decls: Vec<BufferDecl>,
}

impl Buffers {
    pub fn new(arena: Arena, plan: MemoryPlan) -> Buffers {
        Buffers {
            arena,
            decls: plan.decls,
        }
    }

    pub fn ptr(&self, id: RegionId) -> DevicePtr {
        self.arena.region(id)
    }

    /// Declarations and their device buffers, in arena order.
    fn each(&self) -> impl Iterator<Item = (&BufferDecl, DevicePtr)> {
        self.decls
            .iter()
            .zip(self.arena.regions())
            .map(|(d, r)| (d, r.ptr))
    }

    /// `(base, bytes)` covering every buffer of `kind` ((0, 0) if none).
    pub fn span(&self, kind: BufferKind) -> (u64, u64) {
        self.span_of(|d| d.kind == kind)
    }

    /// `(base, bytes)` of the buffer named `name` ((0, 0) if none).
    pub fn named(&self, name: &str) -> (u64, u64) {
        self.span_of(|d| d.name == name)
    }

    fn span_of(&self, pick: impl Fn(&BufferDecl) -> bool) -> (u64, u64) {
        let mut lo = u64::MAX;
        let mut hi = 0u64;
        for (_, p) in self.each().filter(|(d, _)| pick(d)) {
            lo = lo.min(p.addr());
            hi = hi.max(p.addr() + p.bytes() as u64);
        }
        if lo == u64::MAX {
            (0, 0)
        } else {
            (lo, hi - lo)
        }
    }

    /// The derived buffers as dsv4_weight_info lists them (element type and shape as
    /// declared).
    pub fn derived(&self) -> Vec<DerivedTensor> {
        self.each()
            .filter(|(d, _)| d.kind == BufferKind::Derived)
            .map(|(d, p)| DerivedTensor {
                name: d.name.clone(),
                dtype: d.elem,
                shape: d.shape.clone(),
                addr: p.addr(),
                nbytes: d.numel() * d.elem.size(),
            })
            .collect()
    }
}
