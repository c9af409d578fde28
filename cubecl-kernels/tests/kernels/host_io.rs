//! Host writes into existing device buffers: a span (`write_ints`) and scattered entries
//! (`scatter_ints`, the step graphs' block tables): the written entries read back, a view of
//! the buffer taken after the write reads them too (the step graphs take their views inside
//! the captured forward, after the writes), entries not written keep theirs, and an index
//! outside the buffer is an error, not a kernel fault.

use burn::tensor::{DType, Int, Tensor, TensorData};

use super::common::*;

fn values(t: &Tensor<1, Int>) -> Vec<i64> {
    t.clone().into_data().try_into_vec_as::<i64>().unwrap()
}

#[test]
fn scattered_and_span_writes_land_in_place() {
    let device = kernel_device();
    let n: usize = 5000;
    let start: Vec<i32> = (0..n as i32).collect();
    let mut buf =
        Tensor::<1, Int>::from_data(TensorData::new(start.clone(), [n]), (&device, DType::I32));
    let mut want: Vec<i64> = start.iter().map(|&v| v as i64).collect();
    // Scattered entries (distinct indices, as the engine sends), some inside the view.
    let entries: Vec<[i32; 2]> = (0..700i32).map(|k| [k * 7, -k - 1]).collect();
    let entries: Vec<[i32; 2]> = entries
        .into_iter()
        .chain([[4100, 123_456], [4199, -7], [n as i32 - 1, 9]])
        .collect();
    cubecl_kernels::scatter_ints(&mut buf, &entries).unwrap();
    for &[i, v] in &entries {
        want[i as usize] = v as i64;
    }
    assert_eq!(values(&buf), want);
    let view = buf.clone().slice(4096..4200);
    assert_eq!(values(&view), want[4096..4200], "a view sees the writes");
    // A span.
    cubecl_kernels::write_ints(&mut buf, 10, &[1, 2, 3]).unwrap();
    want[10..13].copy_from_slice(&[1, 2, 3]);
    assert_eq!(values(&buf), want);
    // Nothing to write; out of range.
    cubecl_kernels::scatter_ints(&mut buf, &[]).unwrap();
    assert_eq!(values(&buf), want);
    let err = cubecl_kernels::scatter_ints(&mut buf, &[[n as i32, 1]]).unwrap_err();
    assert!(
        err.to_string().contains("outside a buffer of 5000"),
        "{err}"
    );
    let err = cubecl_kernels::scatter_ints(&mut buf, &[[-1, 1]]).unwrap_err();
    assert!(err.to_string().contains("index -1"), "{err}");
    assert_eq!(values(&buf), want);
}
