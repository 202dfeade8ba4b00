//! Kernel declarations: the ONE place a kernel's signature is written on the Rust side.
//!
//! [`kernel_family!`](crate::kernel_family) declares a family (one `kernels/<family>.cu`) and,
//! for every `extern "C" __global__` entry point, its parameters in kernel order with their
//! Rust types and its dynamic shared memory limit. From that it generates
//! - the registry entry (`KernelSource` with one [`KernelFn`] per entry point, carrying the C
//!   type of every parameter, which tests/kernel_decls.rs checks against the .cu text), and
//! - per entry point a module named like the kernel holding `Args`, a struct with one field
//!   per parameter, packed in declaration order by [`Launcher::launch`].
//!
//! ```ignore
//! kernel_family! {
//!     pub const SOURCE = "linear", include_str!("../../../kernels/linear.cu");
//!     /// y = x · Wᵀ (SPEC.md).
//!     fn act_quant_kernel(x: *const f32, ldx: i32, rows: i32, k: i32, xq: *mut f32);
//!     #[smem(ATTENTION_MAX_SMEM)]
//!     fn attention_kernel(...);
//!     /// Starts with dsv4_pdl_begin(): launched as a programmatic dependent (KernelFn::pdl).
//!     #[pdl(true)]
//!     fn fmoe_combine_kernel(...);
//!     /// Clusters of up to 16 blocks (KernelFn::max_cluster; 8 without the attribute).
//!     #[smem(FUSED_MAX_SMEM as u32)]
//!     #[pdl(true)]
//!     #[cluster(16)]
//!     fn fi_select_stream_kernel(...);
//! }
//! // launch: fields by name, so argument order cannot be got wrong at the call site.
//! self.act_quant.launch(grid, block, 0, stream, act_quant_kernel::Args { x, ldx, rows, k, xq })
//! ```
//!
//! Parameter types ([`Param`]): `*const T` / `*mut T` take a [`DevicePtr`]; `Option<*const T>`
//! / `Option<*mut T>` take an `Option<DevicePtr>` (None passes NULL: the kernel treats the
//! pointer as optional); `i32`, `i64`, `u64`, `f32` take themselves; `bool` is a C `int` flag
//! taking a Rust bool (0/1); [`TmaMapParam`] is a tensor map by value (`const __grid_constant__
//! DsvTmaMap`), taking a [`TmaMap`]. `T` is `f32`, `f64`, `i32`, `u16`, `u32`, `u64`, `u8` or `c_void`.
//!
//! The `unsafe` launch lives in [`Launcher::launch`] only. What it relies on: the argument
//! layout (guaranteed by the declaration, checked against the kernel source in CI), and the
//! wrapper having checked every buffer's size with `need` before launching (the wrappers know
//! the shapes; the declaration does not).

use super::arena::DevicePtr;
use super::registry::{Kernel, KernelFn, Registry};
use super::stream::{BorrowedStream, Dim3, KernelArgs, TmaMap, launch_clustered};
use crate::error::Result;
use std::ffi::c_void;
use std::marker::PhantomData;

/// A Rust type that stands for one kernel parameter in a declaration.
pub trait Param {
    /// The parameter's C type as the .cu file spells it, normalised: one space between words,
    /// `*` attached to the type (`const float*`, `unsigned long long*`, `long long`).
    const C: &'static str;
    /// What a launch passes for it.
    type Arg: Copy + std::fmt::Debug;
    /// Appends the argument to a launch's arguments (see [`KernelArgs`]).
    fn push(a: Self::Arg, args: &mut KernelArgs);
}

/// A tensor map passed by value: the kernel's `const __grid_constant__ DsvTmaMap` parameter
/// (kernels/fast_fp8_gemm.cu), 128 bytes.
pub struct TmaMapParam;

impl Param for TmaMapParam {
    const C: &'static str = "const __grid_constant__ DsvTmaMap";
    type Arg = TmaMap;
    fn push(m: TmaMap, args: &mut KernelArgs) {
        args.tma_map(&m);
    }
}

macro_rules! scalar_param {
    ($($t:ty => $c:literal, |$v:ident| $slot:expr;)*) => {$(
        impl Param for $t {
            const C: &'static str = $c;
            type Arg = $t;
            fn push($v: $t, args: &mut KernelArgs) {
                args.u64($slot);
            }
        }
    )*};
}

// Same encodings as KernelArgs::{i32, i64, u64, f32}.
scalar_param! {
    i32 => "int", |v| v as u32 as u64;
    i64 => "long long", |v| v as u64;
    u64 => "unsigned long long", |v| v;
    f32 => "float", |v| v.to_bits() as u64;
    bool => "int", |v| v as u32 as u64;
}

macro_rules! pointer_param {
    ($($t:ty => $c:literal;)*) => {$(
        impl Param for *const $t {
            const C: &'static str = concat!("const ", $c, "*");
            type Arg = DevicePtr;
            fn push(p: DevicePtr, args: &mut KernelArgs) {
                args.u64(p.addr());
            }
        }
        impl Param for *mut $t {
            const C: &'static str = concat!($c, "*");
            type Arg = DevicePtr;
            fn push(p: DevicePtr, args: &mut KernelArgs) {
                args.u64(p.addr());
            }
        }
        impl Param for Option<*const $t> {
            const C: &'static str = <*const $t as Param>::C;
            type Arg = Option<DevicePtr>;
            fn push(p: Option<DevicePtr>, args: &mut KernelArgs) {
                args.u64(p.map_or(0, DevicePtr::addr));
            }
        }
        impl Param for Option<*mut $t> {
            const C: &'static str = <*mut $t as Param>::C;
            type Arg = Option<DevicePtr>;
            fn push(p: Option<DevicePtr>, args: &mut KernelArgs) {
                args.u64(p.map_or(0, DevicePtr::addr));
            }
        }
    )*};
}

pointer_param! {
    f32 => "float";
    f64 => "double";
    i32 => "int";
    u8 => "unsigned char";
    u16 => "unsigned short";
    u32 => "unsigned";
    u64 => "unsigned long long";
    c_void => "void";
}

/// The arguments of one declared entry point (the `Args` struct `kernel_family!` generates).
pub trait KernelDecl: Copy {
    /// The family (`kernels/<family>.cu`) that defines the entry point.
    const FAMILY: &'static str;
    /// Its registry entry.
    const FN: KernelFn;
    /// Appends the arguments in kernel order.
    fn pack(&self, args: &mut KernelArgs);
}

/// A resolved entry point that launches only with its declared arguments `A`.
pub struct Launcher<A> {
    kernel: Kernel,
    _args: PhantomData<fn(A)>,
}

impl<A> Clone for Launcher<A> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<A> Copy for Launcher<A> {}

impl<A: KernelDecl> Launcher<A> {
    /// The entry point `A` declares, from a loaded registry.
    pub fn new(reg: &Registry) -> Result<Launcher<A>> {
        Ok(Launcher {
            kernel: reg.get(A::FAMILY, A::FN.name)?,
            _args: PhantomData,
        })
    }

    /// The entry point `A` declares, resolved in `family` instead of its own: a family compiled
    /// from the same source with other defines, so the same entry points and parameters
    /// (fast_moe_wide's narrow tiles).
    pub fn in_family(reg: &Registry, family: &str) -> Result<Launcher<A>> {
        Ok(Launcher {
            kernel: reg.get(family, A::FN.name)?,
            _args: PhantomData,
        })
    }

    /// The resolved kernel (limits, attributes).
    pub fn kernel(&self) -> &Kernel {
        &self.kernel
    }

    /// Enqueues the kernel on `stream` with `args` (the context must be current). Block size
    /// and dynamic shared memory are checked against the kernel's limits. Every buffer `args`
    /// points to must hold what the kernel touches: the wrapper's `need` checks say so.
    pub fn launch(
        &self,
        grid: impl Into<Dim3>,
        block: impl Into<Dim3>,
        dynamic_smem: u32,
        stream: BorrowedStream,
        args: A,
    ) -> Result<()> {
        self.launch_in(grid.into(), block.into(), dynamic_smem, stream, args, None)
    }

    /// [`Self::launch`] in thread-block clusters of `cluster` blocks.
    pub fn launch_clustered(
        &self,
        grid: impl Into<Dim3>,
        block: impl Into<Dim3>,
        dynamic_smem: u32,
        stream: BorrowedStream,
        args: A,
        cluster: impl Into<Dim3>,
    ) -> Result<()> {
        let c = Some(cluster.into());
        self.launch_in(grid.into(), block.into(), dynamic_smem, stream, args, c)
    }

    fn launch_in(
        &self,
        grid: Dim3,
        block: Dim3,
        dynamic_smem: u32,
        stream: BorrowedStream,
        args: A,
        cluster: Option<Dim3>,
    ) -> Result<()> {
        let mut a = KernelArgs::new();
        args.pack(&mut a);
        debug_assert_eq!(a.len(), A::FN.params.len());
        // SAFETY: `A` was generated from the kernel's declaration, so `a` holds one argument per
        // parameter in the kernel's order with the declared C types (tests/kernel_decls.rs
        // checks each declaration against the `extern "C" __global__` signature in the .cu
        // source); the pointers' extents were checked by the calling wrapper.
        unsafe { launch_clustered(&self.kernel, grid, block, dynamic_smem, stream, &a, cluster) }
    }
}

/// Declares a family's wrapper struct: one [`Launcher`] field per entry point it launches,
/// and `new`, which resolves every one of them from a loaded registry (an error names the
/// first kernel the registry lacks).
///
/// ```ignore
/// launchers! {
///     /// The linear family's entry points, resolved from a loaded registry.
///     pub struct Linear {
///         linear: linear_kernel,
///         act_quant: act_quant_kernel,
///     }
/// }
/// ```
#[macro_export]
#[doc(hidden)]
macro_rules! launchers {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident { $($field:ident: $kernel:ident $(in $family:expr)?),* $(,)? }
    ) => {
        $(#[$meta])*
        $vis struct $name {
            $($field: $crate::cuda::decl::Launcher<$kernel::Args>,)*
        }

        impl $name {
            /// Resolves every entry point from `reg`, which must hold the families.
            pub fn new(reg: &$crate::cuda::registry::Registry) -> $crate::error::Result<$name> {
                Ok($name {
                    $($field: $crate::launchers!(@resolve reg $(, $family)?)?,)*
                })
            }
        }
    };
    (@resolve $reg:ident) => { $crate::cuda::decl::Launcher::new($reg) };
    (@resolve $reg:ident, $family:expr) => { $crate::cuda::decl::Launcher::in_family($reg, $family) };
}

/// Declares a kernel family and its entry points; see the module documentation.
#[macro_export]
#[doc(hidden)]
macro_rules! kernel_family {
    (
        $(#[doc = $fdoc:literal])*
        $vis:vis const $source:ident = $family:literal, $text:expr;
        $(
            $(#[doc = $doc:literal])*
            $(#[smem($smem:expr)])?
            $(#[pdl($pdl:expr)])?
            $(#[cluster($cluster:expr)])?
            fn $name:ident($($arg:ident: $ty:ty),* $(,)?);
        )*
    ) => {
        $(#[doc = $fdoc])*
        $vis const $source: $crate::cuda::registry::KernelSource =
            $crate::cuda::registry::KernelSource {
                family: $family,
                source: $text,
                functions: &[$($name::FN),*],
            };
        $(
            $(#[doc = $doc])*
            #[allow(dead_code)]
            pub mod $name {
                #[allow(unused_imports)]
                use super::*;
                use $crate::cuda::decl::Param;

                /// The registry entry.
                pub const FN: $crate::cuda::registry::KernelFn = $crate::cuda::registry::KernelFn {
                    name: stringify!($name),
                    dynamic_smem: $crate::kernel_family!(@smem $($smem)?),
                    params: &[$(<$ty as Param>::C),*],
                    pdl: $crate::kernel_family!(@pdl $($pdl)?),
                    max_cluster: $crate::kernel_family!(@cluster $($cluster)?),
                };
                const _: () = assert!(
                    FN.params.len() <= $crate::cuda::stream::MAX_KERNEL_ARGS,
                    "more kernel parameters than KernelArgs holds"
                );

                /// The kernel's arguments, one field per parameter; packed in declaration
                /// order.
                #[derive(Clone, Copy, Debug)]
                pub struct Args {
                    $(pub $arg: <$ty as Param>::Arg,)*
                }

                impl $crate::cuda::decl::KernelDecl for Args {
                    const FAMILY: &'static str = $family;
                    const FN: $crate::cuda::registry::KernelFn = FN;
                    fn pack(&self, a: &mut $crate::cuda::stream::KernelArgs) {
                        $(<$ty as Param>::push(self.$arg, a);)*
                    }
                }
            }
        )*
    };
    (@pdl) => { false };
    (@pdl $e:expr) => { $e };
    (@smem) => { 0 };
    (@smem $e:expr) => { $e };
    (@cluster) => { $crate::cuda::registry::PORTABLE_CLUSTER };
    (@cluster $e:expr) => { $e };
}
