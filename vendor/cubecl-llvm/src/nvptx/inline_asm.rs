//! burn-nanovllm patch: inline PTX (`gpu_asm!`, CubeCL's `cube.asm` op) on the NVPTX target.
//!
//! The published 0.11.3 has no lowering for the op on LLVM's routes, so a kernel that writes
//! `gpu_asm!` fails to compile there. This lowers the statements whose operands are scalar
//! registers (`in`/`out` of `f32`, `f64`, 16-, 32- and 64-bit values, at most one output) to an
//! LLVM inline-assembly call, the register classes inferred from the types as `nvcc` does:
//! `f` for `f32`, `d` for `f64`, `h` for 16 bits, `r` for other 32 bits, `l` for 64. Memory
//! operands and several outputs are refused with an error naming the statement.

use crate::prelude::*;
use cubecl_core::ir::dialect::{InlineAsmOp, InputKind, MemoryClobbers};

#[derive(Debug, Error)]
#[error("inline PTX `{asm}`: {why} (this CubeCL lowers scalar register operands only)")]
pub struct InlineAsmUnsupported {
    asm: String,
    why: String,
}

#[op_interface_impl]
impl ToLLVMDialect for InlineAsmOp {
    fn rewrite(
        &self,
        ctx: &mut Context,
        rewriter: &mut DialectConversionRewriter,
        operands_info: &OperandsInfo,
    ) -> Result<()> {
        match ctx.target() {
            LlvmTarget::Nvptx => lower(self, ctx, rewriter, operands_info),
            target => input_err!(
                self.loc(ctx),
                InlineAsmUnsupported {
                    asm: self.asm(ctx).as_str().to_string(),
                    why: format!("the {target:?} target takes no PTX"),
                }
            ),
        }
    }
}

fn lower(
    op: &InlineAsmOp,
    ctx: &mut Context,
    rw: &mut DialectConversionRewriter,
    operands_info: &OperandsInfo,
) -> Result<()> {
    let old_op = op.get_operation();
    let asm = op.asm(ctx).as_str().to_string();
    let refuse = |ctx: &Context, why: String| {
        input_err!(
            op.loc(ctx),
            InlineAsmUnsupported {
                asm: asm.clone(),
                why
            }
        )
    };
    let inputs = op.inputs(ctx);
    let results = op.results(ctx);
    if results.len() > 1 {
        return refuse(ctx, format!("{} outputs", results.len()));
    }
    if let Some(spec) = op.in_specs(ctx).iter().find(|s| s.kind != InputKind::In) {
        return refuse(ctx, format!("a memory operand ({:?})", spec.kind));
    }

    let mut constraints = Vec::with_capacity(results.len() + inputs.len() + 1);
    let mut result_ty: TypeHandle = VoidType::get(ctx).into();
    for &result in &results {
        let ty = converted_type(ctx, operands_info, result);
        let Some(class) = register_class(ctx, ty) else {
            return refuse(ctx, "an output that is not a scalar register".into());
        };
        constraints.push(format!("={class}"));
        result_ty = ty;
    }
    for &input in &inputs {
        let ty = converted_type(ctx, operands_info, input);
        let Some(class) = register_class(ctx, ty) else {
            return refuse(ctx, "an input that is not a scalar register".into());
        };
        constraints.push(class.to_string());
    }
    let nomem = matches!(*op.memory_clobbers(ctx), MemoryClobbers::Nomem);
    if !nomem {
        constraints.push("~{memory}".into());
    }
    let side_effects = !op.pure(ctx);

    let call = llvm::InlineAsmOp::new(
        ctx,
        result_ty,
        inputs,
        &asm,
        &constraints.join(","),
        side_effects,
    );
    rw.insert_op(ctx, &call);
    if results.is_empty() {
        rw.erase_operation(ctx, old_op);
    } else {
        let value = call.get_operation().deref(ctx).get_result(0);
        rw.replace_operation_with_values(ctx, old_op, vec![value]);
    }
    Ok(())
}

/// The LLVM type of `value` once converted.
fn converted_type(ctx: &Context, operands_info: &OperandsInfo, value: Value) -> TypeHandle {
    let ty = operands_info
        .lookup_most_recent_type(value)
        .unwrap_or_else(|| value.get_type(ctx));
    cube_type_to_llvm(ctx, ty)
}

/// The PTX register class of a scalar of type `ty`, if it is one.
fn register_class(ctx: &Context, ty: TypeHandle) -> Option<&'static str> {
    let ty = ty.deref(ctx);
    if ty.is::<FP32Type>() {
        Some("f")
    } else if ty.is::<FP64Type>() {
        Some("d")
    } else if ty.is::<FP16Type>() || ty.is::<BF16Type>() {
        Some("h")
    } else {
        match ty.downcast_ref::<IntegerType>()?.width() {
            16 => Some("h"),
            32 => Some("r"),
            64 => Some("l"),
            _ => None,
        }
    }
}
