//! cuBLASLt plans: one product shape's descriptors, layouts and algorithm (`cublas.rs` enqueues
//! them). The algorithm is the heuristic's ranking within the workspace ([`TUNE_CANDIDATES`] of
//! them, for the caller to time), or for a batch-invariant shape the pick for its weight at
//! [`INVARIANT_REFERENCE_ROWS`] rows with no reduction scheme (no split-K), the same for every
//! `M` and checked against this one (`cublasLtMatmulAlgoCheck`).

use burn::tensor::DType;
use cudarc::cublaslt::{result as lt, sys};

use crate::knobs::Knobs;

/// Workspace handed to every cuBLASLt call (what its split-K algorithms may use).
pub(super) const WORKSPACE_BYTES: usize = 32 << 20;

/// Algorithms of the heuristic's ranking timed when a shape is tuned (module doc).
pub(super) const TUNE_CANDIDATES: usize = 8;

/// Rows of the shape whose heuristic pick a batch-invariant product keeps for every `M` of its
/// weight (decode and prefill sizes alike).
const INVARIANT_REFERENCE_ROWS: u64 = 256;

/// Address alignment, bytes, a batch-invariant product's algorithm is chosen for (whatever the
/// call's own pointers allow: the choice must not change with them).
const INVARIANT_ALIGNMENT: u32 = 16;

/// cuBLAS's `CUBLAS_OP_T` (the cuBLASLt bindings do not carry `cublasOperation_t`).
const CUBLAS_OP_T: i32 = 1;

/// One matmul shape: everything its descriptors and algorithm depend on.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub(super) struct PlanKey {
    pub(super) m: usize,
    pub(super) n: usize,
    pub(super) k: usize,
    /// Row pitches of x, W, y and the added matrix (0: none), in elements.
    pub(super) ld: [usize; 4],
    /// Address alignment of x, W, y and the added matrix, bytes (at most 256).
    pub(super) align: [usize; 4],
    /// The output's dtype (and the operands' unless `fp8`).
    pub(super) dtype: DType,
    /// E4M3 operands and how their scales are applied.
    pub(super) fp8: Option<Fp8ScaleMode>,
    pub(super) bias: bool,
    /// One algorithm for every `M` of this weight, without split-K (batch-invariant).
    pub(super) invariant: bool,
}

/// How cuBLASLt applies an FP8 product's scales.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub(super) enum Fp8ScaleMode {
    /// One scalar each for W and x (`CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F`, the default).
    Scalar,
    /// W's per output feature, x's per row (`CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F`).
    OuterVectors,
}

/// The descriptors and chosen algorithm of one shape.
pub(super) struct Plan {
    pub(super) desc: sys::cublasLtMatmulDesc_t,
    pub(super) a: sys::cublasLtMatrixLayout_t,
    pub(super) b: sys::cublasLtMatrixLayout_t,
    pub(super) d: sys::cublasLtMatrixLayout_t,
    /// The added matrix's layout (`d` when there is none).
    pub(super) c: Option<sys::cublasLtMatrixLayout_t>,
    pub(super) algo: sys::cublasLtMatmulAlgo_t,
    /// The heuristic's ranking (first = its pick), within the workspace.
    pub(super) candidates: Vec<sys::cublasLtMatmulAlgo_t>,
    /// `algo` is the fastest of the candidates, timed.
    pub(super) tuned: bool,
}

impl Plan {
    /// The descriptors of `key`'s shape and its algorithm: the heuristic's ranking (its first
    /// pick chosen), or for a batch-invariant key the reference shape's pick, checked for
    /// this shape.
    pub(super) fn new(
        handle: sys::cublasLtHandle_t,
        key: &PlanKey,
        [in_type, out_type]: [sys::cudaDataType; 2],
        fp8_scales: [u64; 2],
    ) -> Result<Self, String> {
        let err = |what: &str, e: &dyn std::fmt::Debug| format!("{what}: {e:?}");
        let (m, n, k) = (key.m as u64, key.n as u64, key.k as u64);
        let [ldx, ldw, ldy, ldc] = key.ld.map(|l| l as i64);
        let desc = lt::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType::CUDA_R_32F,
        )
        .map_err(|e| err("matmul descriptor", &e))?;
        let typed = |data_type| {
            move |rows, cols, ld| {
                lt::create_matrix_layout(data_type, rows, cols, ld).map_err(|e| err("layout", &e))
            }
        };
        let (operand, layout) = (typed(in_type), typed(out_type));
        let mut plan = Self {
            desc,
            a: operand(k, n, ldw)?,
            b: operand(k, m, ldx)?,
            d: layout(n, m, ldy)?,
            c: if ldc > 0 {
                Some(layout(n, m, ldc)?)
            } else {
                None
            },
            // Replaced by the heuristic's pick below.
            algo: unsafe { std::mem::zeroed() },
            candidates: Vec::new(),
            tuned: false,
        };
        // SAFETY: the descriptors were just created and are owned by `plan` (freed on drop).
        unsafe {
            set_desc(
                desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &CUBLAS_OP_T,
            )?;
            if key.bias {
                set_desc(
                    desc,
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE,
                    &sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
                )?;
            }
            if let Some(mode) = key.fp8 {
                use sys::cublasLtMatmulDescAttributes_t as A;
                if mode == Fp8ScaleMode::OuterVectors {
                    let vector =
                        sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F
                            as i32;
                    set_desc(desc, A::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &vector)?;
                    set_desc(desc, A::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &vector)?;
                }
                // The heuristic refuses scale vectors without their addresses
                // (CUBLAS_STATUS_INVALID_VALUE on the H100): the first call's, replaced by each
                // call's own.
                let [w, x] = fp8_scales.map(|p| p as *const std::ffi::c_void);
                set_desc(desc, A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &w)?;
                set_desc(desc, A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &x)?;
            }
            let pref = lt::create_matmul_pref().map_err(|e| err("preference", &e))?;
            use sys::cublasLtMatmulPreferenceAttributes_t as P;
            let [align_x, align_w, align_y, align_c] = if key.invariant {
                if key
                    .align
                    .iter()
                    .any(|&a| a != 0 && a < INVARIANT_ALIGNMENT as usize)
                {
                    let _ = lt::destroy_matmul_pref(pref);
                    return Err(format!(
                        "a batch-invariant {m}x{n}x{k} product has an operand aligned to fewer \
                         than {INVARIANT_ALIGNMENT} bytes ({:?})",
                        key.align
                    ));
                }
                [INVARIANT_ALIGNMENT; 4]
            } else {
                key.align.map(|a| a as u32)
            };
            let align_c = if plan.c.is_some() { align_c } else { align_y };
            // A batch-invariant product asks about the reference shape, with no reduction
            // scheme (no split-K), and keeps the first answer for every M.
            let reference = if key.invariant {
                let rows = INVARIANT_REFERENCE_ROWS;
                Some((
                    layout(k, rows, ldx)?,
                    layout(n, rows, ldy)?,
                    if ldc > 0 {
                        Some(layout(n, rows, ldc)?)
                    } else {
                        None
                    },
                ))
            } else {
                None
            };
            let (b, d, c) = match reference {
                Some((b, d, c)) => (b, d, c.unwrap_or(d)),
                None => (plan.b, plan.d, plan.c.unwrap_or(plan.d)),
            };
            let heuristic = set_pref(
                pref,
                P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &(WORKSPACE_BYTES as u64),
            )
            .and_then(|()| {
                if key.invariant {
                    // No split of K; or (a knob, to measure) a split whose parts are reduced
                    // apart in a fixed order, never in place.
                    use sys::cublasLtReductionScheme_t as R;
                    let mask = match Knobs::get().invariant_split_k {
                        false => R::CUBLASLT_REDUCTION_SCHEME_NONE as u32,
                        true => {
                            R::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32
                                | R::CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE as u32
                        }
                    };
                    set_pref(pref, P::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask)
                } else {
                    Ok(())
                }
            })
            .and_then(|()| {
                [
                    (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_w),
                    (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_x),
                    (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c),
                    (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_y),
                ]
                .into_iter()
                .try_for_each(|(attribute, align)| set_pref(pref, attribute, &align))
            })
            .and_then(|()| {
                let wanted = if key.invariant { 1 } else { TUNE_CANDIDATES };
                let mut found: Vec<sys::cublasLtMatmulHeuristicResult_t> =
                    vec![std::mem::zeroed(); wanted];
                let mut count = 0;
                sys::cublasLtMatmulAlgoGetHeuristic(
                    handle,
                    desc,
                    plan.a,
                    b,
                    c,
                    d,
                    pref,
                    wanted as i32,
                    found.as_mut_ptr(),
                    &mut count,
                )
                .result()
                .map_err(|e| {
                    err(
                        &format!("no cuBLASLt algorithm for {m}x{n}x{k} {:?}", key.dtype),
                        &e,
                    )
                })?;
                found.truncate(count.max(0) as usize);
                Ok(found)
            });
            if let Some((b, d, c)) = reference {
                let _ = lt::destroy_matrix_layout(b);
                let _ = lt::destroy_matrix_layout(d);
                if let Some(c) = c {
                    let _ = lt::destroy_matrix_layout(c);
                }
            }
            let _ = lt::destroy_matmul_pref(pref);
            plan.candidates = heuristic?
                .into_iter()
                .filter(|h| {
                    h.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
                        && h.workspaceSize <= WORKSPACE_BYTES
                })
                .map(|h| h.algo)
                .collect();
            let Some(&first) = plan.candidates.first() else {
                return Err(format!(
                    "no cuBLASLt algorithm for {m}x{n}x{k} {:?} within {WORKSPACE_BYTES} bytes of workspace",
                    key.dtype
                ));
            };
            plan.algo = first;
            if key.invariant {
                // The reference shape's algorithm must serve this one as it is.
                let mut check: sys::cublasLtMatmulHeuristicResult_t = std::mem::zeroed();
                sys::cublasLtMatmulAlgoCheck(
                    handle,
                    desc,
                    plan.a,
                    plan.b,
                    plan.c.unwrap_or(plan.d),
                    plan.d,
                    &plan.algo,
                    &mut check,
                )
                .result()
                .map_err(|e| {
                    err(
                        &format!(
                            "the batch-invariant cuBLASLt algorithm does not serve {m}x{n}x{k} {:?}",
                            key.dtype
                        ),
                        &e,
                    )
                })?;
                if check.workspaceSize > WORKSPACE_BYTES {
                    return Err(format!(
                        "the batch-invariant cuBLASLt algorithm for {m}x{n}x{k} needs {} bytes of workspace",
                        check.workspaceSize
                    ));
                }
            }
            Ok(plan)
        }
    }
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: created by `Plan::new`, destroyed once.
        unsafe {
            let _ = lt::destroy_matrix_layout(self.a);
            let _ = lt::destroy_matrix_layout(self.b);
            let _ = lt::destroy_matrix_layout(self.d);
            if let Some(c) = self.c {
                let _ = lt::destroy_matrix_layout(c);
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

/// Sets one matmul-preference attribute to `value`.
///
/// # Safety
/// `pref` must be alive and `T` the attribute's type.
unsafe fn set_pref<T>(
    pref: sys::cublasLtMatmulPreference_t,
    attr: sys::cublasLtMatmulPreferenceAttributes_t,
    value: &T,
) -> Result<(), String> {
    // SAFETY: forwarded from the caller.
    unsafe {
        lt::set_matmul_pref_attribute(
            pref,
            attr,
            (value as *const T).cast(),
            std::mem::size_of::<T>(),
        )
    }
    .map_err(|e| format!("preference attribute {attr:?}: {e:?}"))
}

/// Sets one matmul-descriptor attribute to `value`.
///
/// # Safety
/// `desc` must be alive and `T` the attribute's type.
pub(super) unsafe fn set_desc<T>(
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    value: &T,
) -> Result<(), String> {
    // SAFETY: forwarded from the caller.
    unsafe {
        lt::set_matmul_desc_attribute(
            desc,
            attr,
            (value as *const T).cast(),
            std::mem::size_of::<T>(),
        )
    }
    .map_err(|e| format!("matmul attribute {attr:?}: {e:?}"))
}
