//! Result rows: printed as aligned CSV and collected as JSON for docs/BENCHMARKS.md.

use serde_json::{Map, Value};

/// A table of benchmark rows with fixed columns.
pub struct Report {
    name: String,
    columns: Vec<&'static str>,
    rows: Vec<Vec<Value>>,
}

impl Report {
    /// A table called `name` with `columns`; prints its header.
    pub fn new(name: &str, columns: &[&'static str]) -> Self {
        println!("\n## {name}\n{}", columns.join(","));
        Self {
            name: name.into(),
            columns: columns.to_vec(),
            rows: Vec::new(),
        }
    }

    /// Adds and prints a row (floats with 4 significant digits).
    pub fn row(&mut self, values: Vec<Value>) {
        let text: Vec<String> = values
            .iter()
            .map(|v| match v.as_f64() {
                Some(f) if v.is_f64() => format!("{}", significant(f)),
                _ => v
                    .as_str()
                    .map(str::to_string)
                    .unwrap_or_else(|| v.to_string()),
            })
            .collect();
        println!("{}", text.join(","));
        self.rows.push(values);
    }

    /// The table as JSON (`{"name", "rows": [{column: value}]}`).
    pub fn json(&self) -> Value {
        let rows = self
            .rows
            .iter()
            .map(|r| {
                Value::Object(
                    self.columns
                        .iter()
                        .map(|c| c.to_string())
                        .zip(r.iter().cloned())
                        .collect::<Map<_, _>>(),
                )
            })
            .collect();
        serde_json::json!({ "name": self.name, "rows": Value::Array(rows) })
    }
}

fn significant(f: f64) -> f64 {
    if f == 0.0 || !f.is_finite() {
        return f;
    }
    let digits = 4 - f.abs().log10().ceil() as i32;
    let scale = 10f64.powi(digits);
    (f * scale).round() / scale
}

/// The `q` quantile (nearest rank) of `v`; NaN when empty.
pub fn percentile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1]
}
