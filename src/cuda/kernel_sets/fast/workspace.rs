//! The fast set's own workspace (beside the reference set's, which it shares): the fast MoE's
//! buffers for `max_num_tokens`, the sparse attention's split partials, staged batch rows and BF16
//! queries, the dense projections' (for their largest shape) and, when `max_num_tokens` reaches
//! the cuBLASLt crossover, the GEMM path's activation operand and cuBLASLt's own workspace,
//! declared in the engine's memory plan at create.

use crate::config::ModelConfig;
use crate::cuda::DevicePtr;
use crate::cuda::arena::{Arena, RegionId};
use crate::cuda::blockscaled_gemm::{self, GemmShape};
use crate::cuda::kernels::fast_attention::{self, FastAttentionWorkspace};
use crate::cuda::kernels::fast_dense::{self, ActMode, DenseWorkspace, Shape};
use crate::cuda::kernels::fast_dense_gemm::{self, GEMM_MIN_TOKENS, GemmWorkspace};
use crate::cuda::kernels::fast_moe::{self, FastMoeWorkspace};
use crate::cuda::memory_plan::{BufferKind, Elem, MemoryPlan};
use crate::error::Result;
use crate::options::EngineOptions;

/// The fast set's workspace at its arena addresses.
#[derive(Clone, Copy, Debug)]
pub struct Workspace {
    pub moe: FastMoeWorkspace,
    pub dense: DenseWorkspace,
    /// The GEMM path's operand and cuBLASLt's workspace, when planned.
    pub gemm: Option<(GemmWorkspace, DevicePtr)>,
    /// The sparse attention's split partials, staged batch rows and BF16 queries.
    pub attention: FastAttentionWorkspace,
}

/// Arena ids of [`Workspace`]'s buffers ([`fast_moe::workspace_buffers`] order), then the dense
/// projections' four ([`DenseWorkspace`] order).
pub struct WorkspaceIds {
    ids: Vec<RegionId>,
    dense: [RegionId; 4],
    gemm: Option<[RegionId; 4]>,
    attention: [RegionId; 4],
    t: usize,
    k: usize,
    experts: usize,
}

impl Workspace {
    /// Declares every buffer for `cfg` and `opts`.
    pub fn reserve(
        plan: &mut MemoryPlan,
        cfg: &ModelConfig,
        opts: &EngineOptions,
    ) -> Result<WorkspaceIds> {
        let t = opts.max_num_tokens;
        let (k, e) = (cfg.experts_per_tok, cfg.n_routed_experts);
        let buffers = fast_moe::workspace_buffers(t, cfg.hidden_size, cfg.moe_inter, k, e);
        let mut ids = Vec::with_capacity(buffers.len());
        for (name, elem, n) in buffers {
            ids.push(plan.declare(
                BufferKind::Workspace,
                format!("workspace:fast_moe.{name}"),
                elem,
                &[n.max(1)],
            )?);
        }
        let sizes = fast_dense::workspace_sizes(&dense_shapes(cfg));
        // The split counters are u32s, declared as I32 (the same bytes; the arena zeroes them).
        let dense_buffers = [
            ("act", Elem::F16),
            ("scale", Elem::F32),
            ("split_part", Elem::F32),
            ("split_count", Elem::I32),
        ];
        let mut dense = Vec::with_capacity(dense_buffers.len());
        for ((name, elem), n) in dense_buffers.into_iter().zip(sizes) {
            dense.push(plan.declare(
                BufferKind::Workspace,
                format!("workspace:fast_dense.{name}"),
                elem,
                &[n.max(1)],
            )?);
        }
        let shapes = gemm_shapes(cfg);
        let gemm = if t >= GEMM_MIN_TOKENS && !shapes.is_empty() {
            // (No norm makes cuBLASLt's operands in the forward: fd_norm_operands_kernel measured
            // slower than the operand passes, kernels/SPEC.md.)
            let [codes, scale] = fast_dense_gemm::gemm_workspace_sizes(&shapes, t, &[]);
            let grouped: Vec<_> = dense_shapes(cfg)
                .iter()
                .map(|s| (s.n, s.k, s.groups))
                .collect();
            let weight = fast_dense_gemm::gemm_weight_bytes(&grouped);
            let mut decl = |name: &str, elem, n: usize| {
                plan.declare(
                    BufferKind::Workspace,
                    format!("workspace:fast_dense.{name}"),
                    elem,
                    &[n.max(1)],
                )
            };
            Some([
                decl("gemm_operand", Elem::U8, codes)?,
                decl("gemm_scale", Elem::F32, scale)?,
                decl("cublaslt", Elem::U8, blockscaled_gemm::WORKSPACE_BYTES)?,
                decl("gemm_weight", Elem::U8, weight)?,
            ])
        } else {
            None
        };
        let [po, pml] = fast_attention::workspace_floats(cfg.num_heads, cfg.head_dim);
        let staged =
            t * fast_attention::staged_row_bytes(cfg.head_dim, cfg.head_dim - cfg.rope_dim);
        let mut attn = |name: &str, elem, n: usize| {
            plan.declare(
                BufferKind::Workspace,
                format!("workspace:fast_attention.{name}"),
                elem,
                &[n.max(1)],
            )
        };
        let attention = [
            attn("part_o", Elem::F32, po)?,
            attn("part_ml", Elem::F32, pml)?,
            attn("staged_rows", Elem::U8, staged)?,
            attn(
                "q_bf16",
                Elem::U8,
                t * fast_attention::q_bf16_bytes(cfg.num_heads, cfg.head_dim),
            )?,
        ];
        Ok(WorkspaceIds {
            ids,
            dense: [dense[0], dense[1], dense[2], dense[3]],
            gemm,
            attention,
            t,
            k,
            experts: e,
        })
    }

    pub fn resolve(w: &WorkspaceIds, arena: &Arena) -> Workspace {
        let ids: Vec<_> = w.ids.iter().map(|&id| arena.region(id)).collect();
        Workspace {
            moe: FastMoeWorkspace::at(&ids, w.t, w.k, w.experts),
            dense: DenseWorkspace {
                act: arena.region(w.dense[0]),
                scale: arena.region(w.dense[1]),
                split_part: arena.region(w.dense[2]),
                split_count: arena.region(w.dense[3]),
            },
            gemm: w.gemm.map(|[codes, scale, lt, weight]| {
                (
                    GemmWorkspace {
                        codes: arena.region(codes),
                        scale: arena.region(scale),
                        weight: arena.region(weight),
                    },
                    arena.region(lt),
                )
            }),
            attention: FastAttentionWorkspace {
                part_o: arena.region(w.attention[0]),
                part_ml: arena.region(w.attention[1]),
                staged: arena.region(w.attention[2]),
                q_bf16: arena.region(w.attention[3]),
            },
        }
    }
}

/// The shapes of every projection the fast set may run through the dense kernels (those whose
/// stored format they cover; sizing for all of them costs only the largest): wq_a, wq_b, wkv,
/// the grouped wo_a, wo_b, the indexer's wq_b and weights_proj, the compressors' wkv / wgate
/// (overlapping ones twice as wide) and the LM head.
pub fn dense_shapes(cfg: &ModelConfig) -> Vec<Shape> {
    let (d, ql, h, hd) = (
        cfg.hidden_size,
        cfg.q_lora_rank,
        cfg.num_heads,
        cfg.head_dim,
    );
    let (g, r) = (cfg.o_groups.max(1), cfg.o_lora_rank);
    let (hi, di) = (cfg.index_n_heads, cfg.index_head_dim);
    let one = |n, k| Shape { n, k, groups: 1 };
    vec![
        one(ql, d),
        one(h * hd, ql),
        one(hd, d),
        Shape {
            n: r,
            k: h * hd / g,
            groups: g,
        },
        one(d, g * r),
        one(hi * di, ql),
        one(hi, d),
        one(2 * hd, d),
        one(2 * di, d),
        one(cfg.vocab_size, d),
    ]
}

/// The shapes among [`dense_shapes`] the cuBLASLt GEMMs may run, each planned as FP8 with the
/// official act_quant and as BF16 where the GEMMs support it (what a weight is stored as is known
/// only at load; a few plans to spare cost host time at finalize only), and a grouped FP8 one
/// (wo_a) as its groups' BF16 GEMM.
pub fn gemm_shapes(cfg: &ModelConfig) -> Vec<GemmShape> {
    use crate::weights::format::StorageFormat::{Bf16, Fp8};
    let mut out = Vec::new();
    for s in dense_shapes(cfg) {
        let (rows, modes): (usize, &[_]) = if s.groups == 1 {
            (s.n, &[(Fp8, ActMode::Quant), (Bf16, ActMode::Bf16)])
        } else {
            (s.n * s.groups, &[(Fp8, ActMode::F16)])
        };
        for &(format, mode) in modes {
            if let Some(g) =
                fast_dense_gemm::gemm_shape(format, [128, 128], rows, s.k, s.groups, mode)
                && !out.contains(&g)
            {
                out.push(g);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::spec::{StoredAs, tensor_specs};

    #[test]
    fn gemm_shapes_plan_every_single_group_projection_of_flash() {
        use crate::cuda::blockscaled_gemm::GemmKind::{Bf16, Fp8BlockScaled};
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let cfg = ModelConfig::from_path(&dir.join("configs/flash-shaped-4-layers.json")).unwrap();
        let shapes = gemm_shapes(&cfg);
        let has = |kind, n, k| {
            shapes.contains(&GemmShape {
                kind,
                n,
                k,
                out: crate::cuda::blockscaled_gemm::GemmOut::F32,
            })
        };
        // wq_a, wq_b, wkv, wo_b, indexer wq_b as FP8; weights_proj, the compressors, the head.
        for (n, k) in crate::cuda::blockscaled_gemm::FLASH_FP8_PROJECTIONS {
            assert!(has(Fp8BlockScaled, n, k), "FP8 {n} x {k}");
        }
        for (n, k) in [(64, 4096), (1024, 4096), (256, 4096), (129280, 4096)] {
            assert!(has(Bf16, n, k), "BF16 {n} x {k}");
        }
        // wo_a's groups are not a GEMM shape.
        assert!(!has(Fp8BlockScaled, 8192, 4096));
    }

    /// The GEMM operand buffer holds the largest one operand (wo_b's K = 8192 planned as BF16
    /// too: 16 KiB a token at Flash shapes) and, at a norm's K, one operand of each kind side by
    /// side (`norm_group_operands`: u's FP8 and BF16 operands at 4096, 12 KiB, within that); a
    /// norm's K read by one kind needs that operand alone; the scales cover the largest K.
    #[test]
    fn the_gemm_operand_buffer_holds_a_norms_two_operands() {
        use crate::cuda::blockscaled_gemm::{GemmKind, GemmOut};
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let cfg = ModelConfig::from_path(&dir.join("configs/flash-shaped-4-layers.json")).unwrap();
        let t = 300;
        let norm_ks = [cfg.hidden_size, cfg.q_lora_rank];
        let [codes, scale] = fast_dense_gemm::gemm_workspace_sizes(&gemm_shapes(&cfg), t, &norm_ks);
        assert_eq!(codes, t * 2 * 8192);
        assert_eq!(scale, t * 8192 / 128);
        let shape = |kind, k| GemmShape {
            kind,
            n: 512,
            k,
            out: GemmOut::F32,
        };
        let u = [
            shape(GemmKind::Fp8BlockScaled, 4096),
            shape(GemmKind::Bf16, 4096),
            shape(GemmKind::Fp8BlockScaled, 1024),
        ];
        let sizes = |ks: &[usize]| fast_dense_gemm::gemm_workspace_sizes(&u, t, ks)[0];
        assert_eq!(sizes(&[]), t * 2 * 4096, "one operand");
        assert_eq!(
            sizes(&[4096, 1024]),
            t * 3 * 4096,
            "u's two operands side by side"
        );
        assert_eq!(sizes(&[1024]), t * 2 * 4096, "q_lora's FP8 operand alone");
    }

    /// Every matrix the fast set may hand the dense kernels (stored FP8 or BF16) fits the
    /// workspace `dense_shapes` sizes: its K (times wo_a's groups) within the operand buffer's
    /// width, for the configs we ship and the tiny default. A projection added to the model but
    /// not to `dense_shapes` would otherwise fail at the first forward.
    #[test]
    fn the_dense_workspace_holds_every_projection() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let cfgs = [
            ModelConfig::tiny_default(),
            ModelConfig::from_path(&dir.join("configs/flash-shaped-4-layers.json")).unwrap(),
        ];
        for cfg in cfgs {
            let [act, scale, ..] = fast_dense::workspace_sizes(&dense_shapes(&cfg));
            let width = act / fast_dense::TOKENS;
            assert_eq!(scale, fast_dense::TOKENS * width / 128);
            for s in tensor_specs(&cfg) {
                let dense = matches!(s.stored, StoredAs::Fp8Block | StoredAs::Bf16Matrix)
                    && s.shape.len() == 2
                    && !s.name.contains(".experts.")
                    && !s.name.contains("shared_experts")
                    && s.name != "embed.weight";
                if !dense {
                    continue;
                }
                // wo_a runs in o_groups groups whose inputs lie side by side.
                let k = if s.name.ends_with("attn.wo_a.weight") {
                    s.shape[1] * cfg.o_groups
                } else {
                    s.shape[1]
                };
                assert!(
                    k <= width,
                    "{}: K {k} above the operand width {width}",
                    s.name
                );
            }
        }
    }
}
