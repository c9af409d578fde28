// All-reduce (sum) of one tensor over the GPUs of one host, each rank writing to (push) or
// reading from (pull) its peers' buffers through CUDA IPC (NVLink). Compiled at start-up by NVRTC
// for the group's size (RANKS) and element type (ELEM: 0 f32, 1 bf16, 2 f16); no headers.
//
// Layout of every rank's buffer (one IPC allocation, the same offsets on every rank; C =
// `capacity` bytes):
//   [Signal][region 0: 2C][region 1: 2C][region 2: C][region 3: C]
//   push one-shot: region (call parity) holds [RANKS][message]: what each rank sent here;
//   push two-shot: region 2 holds [RANKS][part] received, region 3 [RANKS][part] gathered;
//   pull (the alternative, BURN_NANOVLLM_ALL_REDUCE=pull): regions 0 and 1 start the message of
//   the call's parity, region 2 the reduced part.
// Launch geometry: a 1-D grid of at most MAX_BLOCKS cubes of THREADS threads (at most one per
// multiprocessor, so all are resident), the same on every rank for a given size; element
// vectors of 16 bytes (`vecs` of them), split by a grid stride. Block b of every rank handles
// the same vector indices in every phase, so the barriers between phases are per block: block b
// waits only for block b of each peer.
//
// Sums are in f32 in rank order 0..RANKS (every rank gets the same bits, whatever the batch).
// Reuse: a block's start barrier of call k+1 proves every peer finished call k (stream order);
// the push two-shot's mid barrier proves the peers read what was sent to them. A region written
// before a call's first barrier (push one-shot, pull data) alternates with the block's call
// count. A peer may run ahead by one call, so the barriers wait for "at least this count".
// `abort` (host-mapped) set by the host ends every wait (the group failed; the results are then
// garbage and the engine is ending).

#define MAX_RANKS 8
#define MAX_BLOCKS 128
#define THREADS 512

typedef unsigned int u32;
typedef unsigned long long u64;

struct Ptrs {
  u64 p[MAX_RANKS];
};

struct Signal {
  u32 start[MAX_BLOCKS][MAX_RANKS];
  u32 mid[MAX_BLOCKS][MAX_RANKS];
  u32 calls[MAX_BLOCKS];
};

struct Acc {
  float v[16 / (ELEM == 0 ? 4 : 2)];
};
#define LANES (16 / (ELEM == 0 ? 4 : 2))

__device__ __forceinline__ void st_release(u32* p, u32 v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ u32 ld_acquire(const u32* p) {
  u32 v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ float lane_to_f32(u32 word, int high) {
  unsigned short h = (unsigned short)(high ? (word >> 16) : (word & 0xffff));
#if ELEM == 1
  return __uint_as_float(((u32)h) << 16);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#endif
}

__device__ __forceinline__ u32 f32_to_half_bits(float f) {
#if ELEM == 1
  u32 bits = __float_as_uint(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);                   // round to nearest even
  return bits >> 16;
#else
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return (u32)h;
#endif
}

__device__ __forceinline__ void accumulate(Acc& acc, uint4 v) {
  u32 w[4] = {v.x, v.y, v.z, v.w};
#if ELEM == 0
#pragma unroll
  for (int i = 0; i < 4; i++) acc.v[i] += __uint_as_float(w[i]);
#else
#pragma unroll
  for (int i = 0; i < 4; i++) {
    acc.v[2 * i] += lane_to_f32(w[i], 0);
    acc.v[2 * i + 1] += lane_to_f32(w[i], 1);
  }
#endif
}

__device__ __forceinline__ uint4 pack(const Acc& acc) {
  u32 w[4];
#if ELEM == 0
#pragma unroll
  for (int i = 0; i < 4; i++) w[i] = __float_as_uint(acc.v[i]);
#else
#pragma unroll
  for (int i = 0; i < 4; i++) w[i] = f32_to_half_bits(acc.v[2 * i]) | (f32_to_half_bits(acc.v[2 * i + 1]) << 16);
#endif
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// The sum over ranks 0..RANKS of vector `idx` of each rank's `offset` region, in rank order.
__device__ __forceinline__ uint4 sum_ranks(const Ptrs& base, u64 offset, u64 idx) {
  Acc acc;
#pragma unroll
  for (int i = 0; i < LANES; i++) acc.v[i] = 0.0f;
#pragma unroll
  for (int r = 0; r < RANKS; r++) {
    const uint4* src = (const uint4*)(base.p[r] + offset);
    accumulate(acc, __ldcg(src + idx));
  }
  return pack(acc);
}

// Block b's barrier with block b of every peer: publish `count` in each peer's slot for this
// rank, then wait until every peer's count here is at least `count`.
__device__ __forceinline__ void barrier(const Ptrs& base, int rank, u32 count, int mid,
                                        const volatile u32* abort) {
  __syncthreads();
  if (threadIdx.x < RANKS) {
    Signal* peer = (Signal*)base.p[threadIdx.x];
    Signal* self = (Signal*)base.p[rank];
    u32* slot = mid ? &peer->mid[blockIdx.x][rank] : &peer->start[blockIdx.x][rank];
    const u32* mine = mid ? &self->mid[blockIdx.x][threadIdx.x] : &self->start[blockIdx.x][threadIdx.x];
    st_release(slot, count);
    u32 spins = 0;
    while ((int)(ld_acquire(mine) - count) < 0) {
      if ((++spins & 1023u) == 0 && *abort) break;
    }
  }
  __syncthreads();
}

__device__ __forceinline__ u32 next_call(const Ptrs& base, int rank) {
  return ((Signal*)base.p[rank])->calls[blockIdx.x] + 1;
}

__device__ __forceinline__ void end_call(const Ptrs& base, int rank, u32 count) {
  if (threadIdx.x == 0) ((Signal*)base.p[rank])->calls[blockIdx.x] = count;
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    pull_one_shot(Ptrs base, int rank, u64 x, u64 vecs, u64 capacity, u64 abort) {
  u32 count = next_call(base, rank);
  u64 data = sizeof(Signal) + (u64)(count & 1u) * 2 * capacity;
  uint4* io = (uint4*)x;
  uint4* mine = (uint4*)(base.p[rank] + data);
  u64 stride = (u64)gridDim.x * THREADS;
  for (u64 i = (u64)blockIdx.x * THREADS + threadIdx.x; i < vecs; i += stride) mine[i] = io[i];
  barrier(base, rank, count, 0, (const volatile u32*)abort);
  for (u64 i = (u64)blockIdx.x * THREADS + threadIdx.x; i < vecs; i += stride) io[i] = sum_ranks(base, data, i);
  end_call(base, rank, count);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    pull_two_shot(Ptrs base, int rank, u64 x, u64 vecs, u64 capacity, u64 abort) {
  u32 count = next_call(base, rank);
  u64 data = sizeof(Signal) + (u64)(count & 1u) * 2 * capacity;
  u64 scratch = sizeof(Signal) + 4 * capacity;
  u64 part = vecs / RANKS;
  uint4* io = (uint4*)x;
  uint4* mine = (uint4*)(base.p[rank] + data);
  uint4* reduced = (uint4*)(base.p[rank] + scratch);
  u64 stride = (u64)gridDim.x * THREADS;
  u64 first = (u64)blockIdx.x * THREADS + threadIdx.x;
  for (u64 i = first; i < part; i += stride) {
#pragma unroll
    for (int p = 0; p < RANKS; p++) mine[p * part + i] = io[p * part + i];
  }
  barrier(base, rank, count, 0, (const volatile u32*)abort);
  for (u64 i = first; i < part; i += stride) {
    uint4 s = sum_ranks(base, data + (u64)rank * part * 16, i);
    reduced[i] = s;
    io[rank * part + i] = s;
  }
  barrier(base, rank, count, 1, (const volatile u32*)abort);
  for (u64 i = first; i < part; i += stride) {
#pragma unroll
    for (int p = 0; p < RANKS; p++) {
      if (p == rank) continue;
      const uint4* theirs = (const uint4*)(base.p[p] + scratch);
      io[p * part + i] = __ldcg(theirs + i);
    }
  }
  end_call(base, rank, count);
}

// The sum of vector `idx` of `RANKS` consecutive slices of `slice` vectors at `src` (this rank's
// memory), in rank order.
__device__ __forceinline__ uint4 sum_slices(const uint4* src, u64 slice, u64 idx) {
  Acc acc;
#pragma unroll
  for (int i = 0; i < LANES; i++) acc.v[i] = 0.0f;
#pragma unroll
  for (int r = 0; r < RANKS; r++) accumulate(acc, __ldcg(src + r * slice + idx));
  return pack(acc);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    push_one_shot(Ptrs base, int rank, u64 x, u64 vecs, u64 capacity, u64 abort) {
  u32 count = next_call(base, rank);
  u64 region = sizeof(Signal) + (u64)(count & 1u) * 2 * capacity;
  uint4* io = (uint4*)x;
  u64 stride = (u64)gridDim.x * THREADS;
  u64 first = (u64)blockIdx.x * THREADS + threadIdx.x;
  for (u64 i = first; i < vecs; i += stride) {
    uint4 v = io[i];
#pragma unroll
    for (int p = 0; p < RANKS; p++) ((uint4*)(base.p[p] + region))[rank * vecs + i] = v;
  }
  barrier(base, rank, count, 0, (const volatile u32*)abort);
  const uint4* received = (const uint4*)(base.p[rank] + region);
  for (u64 i = first; i < vecs; i += stride) io[i] = sum_slices(received, vecs, i);
  end_call(base, rank, count);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    push_two_shot(Ptrs base, int rank, u64 x, u64 vecs, u64 capacity, u64 abort) {
  u32 count = next_call(base, rank);
  u64 received = sizeof(Signal) + 4 * capacity;
  u64 gathered = received + capacity;
  u64 part = vecs / RANKS;
  uint4* io = (uint4*)x;
  u64 stride = (u64)gridDim.x * THREADS;
  u64 first = (u64)blockIdx.x * THREADS + threadIdx.x;
  for (u64 i = first; i < part; i += stride) {
#pragma unroll
    for (int p = 0; p < RANKS; p++) ((uint4*)(base.p[p] + received))[rank * part + i] = io[p * part + i];
  }
  barrier(base, rank, count, 0, (const volatile u32*)abort);
  for (u64 i = first; i < part; i += stride) {
    uint4 s = sum_slices((const uint4*)(base.p[rank] + received), part, i);
#pragma unroll
    for (int p = 0; p < RANKS; p++) ((uint4*)(base.p[p] + gathered))[rank * part + i] = s;
  }
  barrier(base, rank, count, 1, (const volatile u32*)abort);
  const uint4* all = (const uint4*)(base.p[rank] + gathered);
  for (u64 i = first; i < part; i += stride) {
#pragma unroll
    for (int p = 0; p < RANKS; p++) io[p * part + i] = __ldcg(all + p * part + i);
  }
  end_call(base, rank, count);
}
