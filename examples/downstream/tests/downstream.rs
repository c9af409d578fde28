//! The downstream crate's checks: the fused block computes what the Burn-module block computes
//! (on CubeCL's CPU runtime, where the kernels run, and on Burn's Flex backend), and the engine,
//! used as a library, reproduces transformers' greedy continuation of the default model.

use burn::tensor::{DType, Distribution, Tensor};
use burn_nanovllm::{DeviceKind, EngineConfig, LLM, Prompt, SamplingParams};
use downstream::{Block, BlockConfig, FusedBlock};

fn relative_difference(a: Tensor<3>, b: Tensor<3>) -> f32 {
    let (a, b) = (a.cast(DType::F32), b.cast(DType::F32));
    let num = (a.clone() - b).square().sum().into_scalar::<f32>();
    (num / a.square().sum().into_scalar::<f32>()).sqrt()
}

#[test]
fn fused_block_matches_burn_modules() {
    let config = BlockConfig {
        hidden: 64,
        heads: 4,
        intermediate: 160,
    };
    for (device, dtype, tol) in [
        (DeviceKind::CubeclCpu, DType::F32, 1e-5),
        (DeviceKind::CubeclCpu, DType::BF16, 2e-2),
        (DeviceKind::Cpu, DType::F32, 1e-5),
    ] {
        let dev = device.device().unwrap();
        let block = Block::random(config, dtype, &dev);
        let fused = FusedBlock::from_block(&block);
        let x = Tensor::<3>::random([2, 9, 64], Distribution::Default, (&dev, dtype));
        let (a, b) = (block.forward(x.clone()), fused.forward(x));
        assert_eq!(b.dims(), [2, 9, 64]);
        let err = relative_difference(a, b);
        assert!(err < tol, "{device:?} {dtype:?}: relative difference {err:e} ≥ {tol:e}");
    }
}

#[test]
fn library_generation_matches_transformers() {
    let dir = burn_nanovllm::default_model_dir();
    let golden: serde_like::Golden = serde_like::read(&dir.join("golden.json"));
    let mut llm = LLM::new(&dir, EngineConfig::default()).unwrap();
    let prompts: Vec<Prompt> = golden.prompts.iter().map(|p| Prompt::Tokens(p.0.clone())).collect();
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(24)
    };
    let out = llm.generate(&prompts, &params).unwrap();
    for (o, p) in out.iter().zip(&golden.prompts) {
        assert_eq!(o.token_ids, p.1, "greedy continuation of {:?}", p.0);
    }
}

/// The goldens stored beside the default model (transformers, float32).
mod serde_like {
    pub struct Golden {
        /// (prompt ids, greedy ids) per prompt.
        pub prompts: Vec<(Vec<u32>, Vec<u32>)>,
    }

    pub fn read(path: &std::path::Path) -> Golden {
        let text = std::fs::read_to_string(path).unwrap();
        let json: serde_json::Value = serde_json::from_str(&text).unwrap();
        let ids = |v: &serde_json::Value| -> Vec<u32> {
            v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
        };
        Golden {
            prompts: json["prompts"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| (ids(&p["input_ids"]), ids(&p["greedy_ids"])))
                .collect(),
        }
    }
}
