//! Every op's backward against central finite differences in f64, plus the engine's rules.

use sluice_autograd::gradcheck::gradcheck;
use sluice_autograd::{cat, cross_entropy, embedding, linear, nll_loss, DType, Error, Tensor};

fn rand(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn(shape, 1.0, seed, DType::F64).unwrap()
}

fn positive(shape: &[usize], seed: u64) -> Tensor {
    Tensor::uniform(shape, 0.5, 2.0, seed, DType::F64).unwrap()
}

fn check(name: &str, f: impl Fn(&[Tensor]) -> sluice_autograd::Result<Tensor>, inputs: &[Tensor]) {
    let worst = gradcheck(f, inputs, 1e-6, 1e-5).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert!(worst < 1e-5, "{name}: {worst}");
}

#[test]
fn binary_ops_with_broadcasting() {
    let (a, b, row, col) = (rand(&[3, 4], 1), rand(&[3, 4], 2), rand(&[4], 3), positive(&[3, 1], 4));
    check("add", |x| x[0].add(&x[1]), &[a.clone(), row.clone()]);
    check("sub", |x| x[0].sub(&x[1]), &[a.clone(), col.clone()]);
    check("mul", |x| x[0].mul(&x[1]), &[a.clone(), b.clone()]);
    check("mul broadcast", |x| x[0].mul(&x[1]), &[col.clone(), row.clone()]);
    check("div", |x| x[0].div(&x[1]), &[a.clone(), col.clone()]);
    check("div both", |x| x[0].div(&x[1]), &[row.clone(), positive(&[3, 4], 5)]);
    check("scalars", |x| x[0].mul_scalar(3.0)?.add_scalar(1.0), &[a]);
}

#[test]
fn unary_ops() {
    let x = rand(&[2, 5], 6);
    check("neg", |x| x[0].neg(), std::slice::from_ref(&x));
    check("exp", |x| x[0].exp(), std::slice::from_ref(&x));
    check("log", |x| x[0].log(), &[positive(&[2, 5], 7)]);
    // Keep relu's inputs away from the kink at 0.
    let away = Tensor::from_vec(vec![-1.5, -0.3, 0.4, 2.0, 0.7, -0.9], &[2, 3]).unwrap();
    check("relu", |x| x[0].relu(), &[away]);
    check("tanh", |x| x[0].tanh(), std::slice::from_ref(&x));
    check("sigmoid", |x| x[0].sigmoid(), std::slice::from_ref(&x));
    check("cos", |x| x[0].cos(), std::slice::from_ref(&x));
    check("sin", |x| x[0].sin(), &[x]);
}

#[test]
fn matmul_linear_and_transposes() {
    let (a, b) = (rand(&[3, 4], 8), rand(&[4, 5], 9));
    check("matmul", |x| x[0].matmul(&x[1]), &[a.clone(), b.clone()]);
    check(
        "matmul of transposed views",
        |x| x[0].t()?.matmul(&x[1].t()?),
        &[rand(&[4, 3], 10), rand(&[5, 4], 11)],
    );
    let (w, bias) = (rand(&[5, 4], 12), rand(&[5], 13));
    check("linear", |x| linear(&x[0], &x[1], Some(&x[2])), &[a, w, bias]);
}

#[test]
fn reductions_and_softmax() {
    let x = rand(&[3, 4], 14);
    check("sum", |x| x[0].sum(), std::slice::from_ref(&x));
    check("sum_dim 0", |x| x[0].sum_dim(0, false), std::slice::from_ref(&x));
    check("sum_dim -1 keep", |x| x[0].sum_dim(-1, true), std::slice::from_ref(&x));
    check("mean", |x| x[0].mean(), std::slice::from_ref(&x));
    check("mean_dim", |x| x[0].mean_dim(1, false), std::slice::from_ref(&x));
    check("softmax", |x| x[0].softmax(-1), std::slice::from_ref(&x));
    check("softmax dim 0", |x| x[0].softmax(0), std::slice::from_ref(&x));
    check("log_softmax", |x| x[0].log_softmax(1), std::slice::from_ref(&x));
    let t = Tensor::indices(&[1, 0, 3], &[3]).unwrap();
    let t2 = t.clone();
    check(
        "nll_loss",
        move |x| nll_loss(&x[0].log_softmax(-1)?, &t),
        std::slice::from_ref(&x),
    );
    check("cross_entropy", move |x| cross_entropy(&x[0], &t2), &[x]);
}

#[test]
fn shape_ops() {
    let x = rand(&[2, 3, 4], 15);
    check(
        "reshape",
        |x| x[0].reshape(&[6, 4])?.mul_scalar(2.0),
        std::slice::from_ref(&x),
    );
    check(
        "transpose",
        |x| x[0].transpose(0, 2)?.reshape(&[24]),
        std::slice::from_ref(&x),
    );
    check("narrow", |x| x[0].narrow(2, 1, 2), std::slice::from_ref(&x));
    check(
        "split",
        |x| {
            let parts = x[0].split(&[1, 2], 1)?;
            parts[0].sum_dim(1, true)?.add(&parts[1].mul_scalar(3.0)?)
        },
        std::slice::from_ref(&x),
    );
    check(
        "cat",
        |x| cat(&[x[0].clone(), x[1].mul_scalar(2.0)?], 1),
        &[rand(&[2, 3], 16), rand(&[2, 5], 17)],
    );
    let idx = Tensor::indices(&[2, 0, 2, 1], &[4]).unwrap();
    check("index_rows", move |x| x[0].index_rows(&idx), &[rand(&[3, 4], 18)]);
}

#[test]
fn gather_and_index_select() {
    // Values against the definition, on a 2×3 tensor whose elements name their coordinates.
    let x = Tensor::from_vec(vec![0.0, 1.0, 2.0, 10.0, 11.0, 12.0], &[2, 3]).unwrap();
    let idx = Tensor::from_vec(vec![2i64, 2, 0, 1, 0, 1, 1, 2], &[2, 4]).unwrap();
    let g = x.gather(1, &idx).unwrap();
    assert_eq!(g.shape(), &[2, 4]);
    assert_eq!(
        g.to_vec::<f64>().unwrap(),
        vec![2.0, 2.0, 0.0, 1.0, 10.0, 11.0, 11.0, 12.0]
    );
    let rows = Tensor::from_vec(vec![1i64, 0, 1], &[3, 1]).unwrap();
    assert_eq!(
        x.gather(0, &rows).unwrap().to_vec::<f64>().unwrap(),
        vec![10.0, 0.0, 10.0]
    );
    let cols = Tensor::indices(&[2, 0, 2], &[3]).unwrap();
    let s = x.index_select(1, &cols).unwrap();
    assert_eq!(s.shape(), &[2, 3]);
    assert_eq!(s.to_vec::<f64>().unwrap(), vec![2.0, 0.0, 2.0, 12.0, 10.0, 12.0]);
    // Gradients (repeated indices accumulate), in every dimension of a 3-d tensor.
    let idx3 = Tensor::from_vec(vec![0i64, 3, 3, 1, 2, 0, 0, 0, 1, 3, 2, 2], &[2, 2, 3]).unwrap();
    for dim in 0..3 {
        let index = match dim {
            0 => Tensor::from_vec(vec![1i64, 0, 1, 1, 0, 0, 1, 1, 1, 0, 0, 1], &[2, 2, 3]).unwrap(),
            1 => Tensor::from_vec(vec![2i64, 0, 2, 1, 1, 0, 0, 2, 2, 1, 0, 1], &[2, 2, 3]).unwrap(),
            _ => idx3.clone(),
        };
        check(
            &format!("gather {dim}"),
            move |x| x[0].gather(dim, &index),
            &[rand(&[2, 3, 4], 40 + dim as u64)],
        );
        let picks = Tensor::indices(&[1, 0, 1, 1], &[4]).unwrap();
        check(
            &format!("index_select {dim}"),
            move |x| x[0].index_select(dim, &picks)?.mul_scalar(2.0),
            &[rand(&[2, 3, 4], 50 + dim as u64)],
        );
    }
    // Views and negative dimensions: a transposed input and a transposed index read as their
    // logical values; -1 is the last dimension.
    let xt = x.t().unwrap(); // [[0, 10], [1, 11], [2, 12]]
    let it = Tensor::from_vec(vec![1i64, 0, 0, 1, 1, 1], &[2, 3])
        .unwrap()
        .t()
        .unwrap();
    // it = [[1, 1], [0, 1], [0, 1]]
    assert_eq!(
        xt.gather(-1, &it).unwrap().to_vec::<f64>().unwrap(),
        vec![10.0, 10.0, 1.0, 11.0, 2.0, 12.0]
    );
    assert_eq!(
        xt.index_select(-1, &Tensor::indices(&[1], &[1]).unwrap())
            .unwrap()
            .to_vec::<f64>()
            .unwrap(),
        vec![10.0, 11.0, 12.0]
    );
    // Any dtype moves (gradients need f32 or f64); an empty index picks nothing, whatever its
    // other dimensions.
    let ints = Tensor::from_vec(vec![5i64, 6, 7], &[3]).unwrap();
    let back = Tensor::from_vec(vec![2i64, 2, 0], &[3]).unwrap();
    assert_eq!(ints.gather(0, &back).unwrap().to_vec::<i64>().unwrap(), vec![7, 7, 5]);
    assert_eq!(
        ints.index_select(0, &back).unwrap().to_vec::<i64>().unwrap(),
        vec![7, 7, 5]
    );
    let none = Tensor::from_vec(Vec::<i64>::new(), &[0, 9]).unwrap();
    assert_eq!(x.gather(1, &none).unwrap().shape(), &[0, 9]);
    let nothing = Tensor::from_vec(Vec::<i64>::new(), &[0]).unwrap();
    assert_eq!(x.index_select(1, &nothing).unwrap().shape(), &[2, 0]);
    // Mistakes are errors naming the op.
    assert!(matches!(x.gather(2, &idx), Err(Error::Shape { op: "gather", .. })));
    let wide = Tensor::from_vec(vec![0i64; 8], &[4, 2]).unwrap();
    assert!(matches!(x.gather(1, &wide), Err(Error::Shape { op: "gather", .. })));
    let past = Tensor::from_vec(vec![3i64], &[1, 1]).unwrap();
    assert!(matches!(x.gather(1, &past), Err(Error::Index { op: "gather", .. })));
    assert!(matches!(
        x.index_select(1, &past),
        Err(Error::Shape { op: "index_select", .. })
    ));
    let far = Tensor::indices(&[0], &[1]).unwrap();
    assert!(matches!(
        x.index_select(2, &far),
        Err(Error::Shape { op: "index_select", .. })
    ));
    let five = Tensor::from_vec(vec![5i64], &[1]).unwrap();
    assert!(matches!(
        x.index_select(1, &five),
        Err(Error::Index { op: "index_select", .. })
    ));
}

#[test]
fn embedding_gradient_is_sparse_and_right() {
    let idx = Tensor::indices(&[4, 1, 4, 0], &[2, 2]).unwrap();
    let idx2 = idx.clone();
    check("embedding", move |x| embedding(&x[0], &idx), &[rand(&[6, 3], 19)]);
    let w = rand(&[6, 3], 20).requires_grad_();
    embedding(&w, &idx2).unwrap().sum().unwrap().backward().unwrap();
    let g = w.grad().unwrap();
    assert!(g.is_sparse(), "embedding's weight gradient is sparse rows");
    assert_eq!(g.sparse_indices().unwrap(), &[4, 1, 4, 0]);
    let dense = g.to_dense().unwrap().to_vec::<f64>().unwrap();
    assert_eq!(&dense[12..15], &[2.0, 2.0, 2.0], "row 4 used twice");
    assert_eq!(&dense[6..9], &[0.0, 0.0, 0.0], "row 2 never used");
}

#[test]
fn engine_accumulates_shared_subgraphs_and_leaves() {
    // y = x·x used twice: dy/dx flows along both paths and into one leaf.
    let x = Tensor::from_vec(vec![3.0f64], &[1]).unwrap().requires_grad_();
    let y = x.mul(&x).unwrap();
    let z = y.add(&y.mul_scalar(2.0).unwrap()).unwrap().sum().unwrap();
    z.backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f64>().unwrap(), vec![18.0]);
    // A second backward through a freed graph fails; with retain_graph it accumulates.
    assert!(matches!(z.backward(), Err(Error::GraphFreed(_))));
    x.zero_grad();
    let z = x.mul(&x).unwrap().sum().unwrap();
    z.backward_with(None, true).unwrap();
    z.backward_with(None, true).unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f64>().unwrap(), vec![12.0]);
}

#[test]
fn roots_must_be_scalar_and_need_grad() {
    let x = Tensor::ones(&[2], DType::F32).unwrap();
    assert!(x
        .sum()
        .unwrap()
        .backward()
        .unwrap_err()
        .to_string()
        .contains("requires_grad"));
    let x = x.requires_grad_();
    assert!(x
        .mul_scalar(2.0)
        .unwrap()
        .backward()
        .unwrap_err()
        .to_string()
        .contains("not a scalar"));
}

#[test]
fn bad_shapes_and_dtypes_are_errors() {
    let a = Tensor::zeros(&[2, 3], DType::F32).unwrap();
    assert!(matches!(
        a.add(&Tensor::zeros(&[4], DType::F32).unwrap()),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(a.matmul(&a), Err(Error::Shape { .. })));
    assert!(matches!(
        a.add(&Tensor::zeros(&[2, 3], DType::F64).unwrap()),
        Err(Error::Shape { .. })
    ));
    let h = a.to_dtype(DType::F16).unwrap();
    assert!(matches!(h.exp(), Err(Error::DType { .. })));
    assert_eq!(h.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap(), vec![0.0; 6]);
    let idx = Tensor::indices(&[5], &[1]).unwrap();
    assert!(matches!(a.index_rows(&idx), Err(Error::Index { .. })));
    assert!(Tensor::from_bytes(bytes::Bytes::from(vec![0u8; 8]), DType::F32, &[3], &[1], 0).is_err());
}

#[test]
fn f32_matmul_matches_f64() {
    let a = rand(&[17, 33], 21);
    let b = rand(&[33, 9], 22);
    let exact = a.matmul(&b).unwrap().to_vec::<f64>().unwrap();
    let (a32, b32) = (a.to_dtype(DType::F32).unwrap(), b.to_dtype(DType::F32).unwrap());
    let approx = a32.matmul(&b32).unwrap().to_f64_vec().unwrap();
    for (x, y) in exact.iter().zip(&approx) {
        assert!((x - y).abs() < 1e-4 * (1.0 + x.abs()));
    }
}
