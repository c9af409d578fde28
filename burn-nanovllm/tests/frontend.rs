//! Front-end tests on the CPU: the OpenAI-compatible server on loopback (a real OpenAI client,
//! streaming and not, concurrency, disconnects, errors, a bounded flood, structured outputs and
//! tool calls) and the Hugging Face cache resolver on a fake cache tree; `serve` as a process
//! under hostile prompts. One test binary (modules below) for link time.

mod frontend {
    mod fuzz;
    mod hostile;
    mod hub;
    mod server;
    mod structured;
    mod surface;
}
