//! Model tests on the CPU (Flex backend, f32) against the Hugging Face goldens in `fixtures/`.
//! One test binary (modules below) to keep link time low.

mod qwen2 {
    pub mod common;
    mod config;
    mod loader;
    mod parity;
    mod tensor_parallel;
    mod tokenizer;
}
