//! Engine tests on the CPU: the block manager and scheduler (unit and property tests), the
//! sampler against its host reference, and generation through `LLMEngine` against the
//! transformers goldens of the tiny fixtures and of the trained default model. One test binary (modules below) for link time.

mod engine {
    mod batch_invariance;
    mod block_manager;
    pub mod common;
    mod cpu_targets;
    mod default_model;
    mod fp8;
    pub mod generation;
    mod overlap;
    mod sampler;
    mod scheduler;
    mod shape_sweep;
    mod step_graphs;
    mod structured;
    mod tensor_parallel;
}
