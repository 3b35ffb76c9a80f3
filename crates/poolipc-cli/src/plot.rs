//! `poolipc bench --plot FILE.svg`: the round trips as a chart, one line per series.
//!
//! Log–log: tensor size in bytes across (powers of two, labelled `4 KiB`, `1 MiB`, ...), round
//! trip in microseconds up; a point per measurement, joined per series, and a legend. Drawn with
//! plotters' SVG backend alone: no bitmap backend, no system library, and no font is loaded (with
//! neither of plotters' `ttf` nor `ab_glyph` features, text is sized by plotters' own estimate and
//! written as SVG `<text>`, which the viewer renders with its own fonts).
//!
//! The chart is rendered into a string first and then written, so a path that cannot be written
//! is an error naming it, and a half-written chart never replaces the file.

use std::path::Path;

use anyhow::{Context, Result, bail};
use plotters::prelude::*;

/// One line of the chart: its name in the legend, and `(bytes, round trip in µs)` per size.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Series {
    /// The legend's words for it (`pool pointer, first touch`, `host copy`, ...).
    pub name: String,
    /// `(tensor size in bytes, round trip in µs)`, in any order.
    pub points: Vec<(u64, f64)>,
}

/// The SVG's size in pixels.
const SIZE: (u32, u32) = (960, 600);

/// The lines' colours, in order (then again): dark enough on white, told apart by most colour
/// blind readers (Okabe–Ito, without its yellow).
const COLORS: [RGBColor; 8] = [
    RGBColor(120, 60, 160),
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(86, 180, 233),
    RGBColor(230, 159, 0),
    RGBColor(0, 0, 0),
];

/// Writes the chart of `series` to `path` as SVG.
///
/// Points that a log scale cannot show (0 bytes, a time that is 0, negative or not finite) are
/// left out; a series left with none still gets its legend entry. It is an error (never a panic)
/// when no series has a point to show, or when `path` cannot be written.
pub(crate) fn plot_round_trips(path: &Path, title: &str, series: &[Series]) -> Result<()> {
    let svg = render(title, series)?;
    std::fs::write(path, svg).with_context(|| format!("writing the chart to {}", path.display()))
}

/// The points of `s` a log–log chart can show, sorted by size.
fn plottable(s: &Series) -> Vec<(f64, f64)> {
    let mut pts: Vec<(f64, f64)> = s
        .points
        .iter()
        .filter(|&&(bytes, us)| bytes > 0 && us.is_finite() && us > 0.0)
        .map(|&(bytes, us)| (bytes as f64, us))
        .collect();
    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    pts
}

/// `[lo, hi]` widened by a factor of `pad` each way, so that the extreme points sit inside the
/// frame and a single value still makes a range.
fn padded(lo: f64, hi: f64, pad: f64) -> std::ops::Range<f64> {
    (lo / pad)..(hi * pad)
}

/// The chart as SVG text.
fn render(title: &str, series: &[Series]) -> Result<String> {
    let lines: Vec<(&str, Vec<(f64, f64)>)> = series
        .iter()
        .map(|s| (s.name.as_str(), plottable(s)))
        .collect();
    let all = || lines.iter().flat_map(|(_, p)| p.iter().copied());
    let (Some(x_lo), Some(x_hi), Some(y_lo), Some(y_hi)) = (
        all().map(|p| p.0).reduce(f64::min),
        all().map(|p| p.0).reduce(f64::max),
        all().map(|p| p.1).reduce(f64::min),
        all().map(|p| p.1).reduce(f64::max),
    ) else {
        bail!(
            "nothing to plot: no series has a point with more than 0 bytes and a finite round \
             trip of more than 0 µs"
        );
    };

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(draw_err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(48)
            .y_label_area_size(72)
            .build_cartesian_2d(
                padded(x_lo, x_hi, 1.5).log_scale().base(2.0),
                padded(y_lo, y_hi, 1.5).log_scale(),
            )
            .map_err(draw_err)?;
        chart
            .configure_mesh()
            .x_desc("tensor size")
            .y_desc("round trip (µs)")
            .x_labels(12)
            .y_labels(10)
            .x_label_formatter(&|b| bytes_label(*b))
            .y_label_formatter(&|us| micros_label(*us))
            .draw()
            .map_err(draw_err)?;
        // A series measured under MPS ("MPS: ...") shares its plain twin's color, drawn thin
        // with crosses, so each rung reads as one color in both runs.
        let mut bases: Vec<&str> = Vec::new();
        for (name, pts) in &lines {
            let mps = name.starts_with("MPS: ");
            let base = name.trim_start_matches("MPS: ");
            let i = bases.iter().position(|b| *b == base).unwrap_or_else(|| {
                bases.push(base);
                bases.len() - 1
            });
            let color = COLORS[i % COLORS.len()].to_rgba();
            let width = if mps { 1 } else { 2 };
            chart
                .draw_series(LineSeries::new(
                    pts.iter().copied(),
                    color.stroke_width(width),
                ))
                .map_err(draw_err)?
                .label(*name)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(width))
                });
            if mps {
                chart
                    .draw_series(pts.iter().map(|&c| Cross::new(c, 4, color.stroke_width(1))))
                    .map_err(draw_err)?;
            } else {
                chart
                    .draw_series(PointSeries::of_element(
                        pts.iter().copied(),
                        3,
                        color.filled(),
                        &|c, size, style| Circle::new(c, size, style),
                    ))
                    .map_err(draw_err)?;
            }
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(draw_err)?;
        root.present().map_err(draw_err)?;
    }
    Ok(svg)
}

/// A plotters error as an `anyhow` one (plotters' errors borrow nothing, but their type carries
/// the backend's, which need not be `Sync`).
fn draw_err(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!("drawing the chart: {e}")
}

/// `4096.0` as `4 KiB`, `1.5 * 2^20` as `1.5 MiB`: the binary unit that keeps the number under
/// 1024.
fn bytes_label(bytes: f64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = bytes;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    let text = format!("{v:.1}");
    let text = text.strip_suffix(".0").unwrap_or(&text);
    format!("{text} {}", UNITS[unit])
}

/// Microseconds with as many decimals as their size needs: `12`, `1.5`, `0.25`.
fn micros_label(us: f64) -> String {
    if us >= 10.0 {
        format!("{us:.0}")
    } else if us >= 1.0 {
        format!("{us:.1}")
    } else {
        format!("{us:.2}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(name: &str, scale: f64) -> Series {
        Series {
            name: name.to_owned(),
            points: (12..=32)
                .step_by(2)
                .map(|p| (1u64 << p, scale * (1.0 + (1u64 << p) as f64 / 1e6)))
                .collect(),
        }
    }

    /// Whether `text`'s tags nest: every opened element is closed in order (self-closing ones
    /// and `<?...?>`/`<!...>` apart). Enough to call an SVG well-formed for this test.
    fn tags_nest(text: &str) -> bool {
        let mut open: Vec<&str> = Vec::new();
        let mut rest = text;
        while let Some(start) = rest.find('<') {
            let Some(len) = rest[start..].find('>') else {
                return false;
            };
            let tag = &rest[start + 1..start + len];
            rest = &rest[start + len + 1..];
            if tag.starts_with('?') || tag.starts_with('!') || tag.ends_with('/') {
                continue;
            }
            if let Some(name) = tag.strip_prefix('/') {
                if open.pop() != Some(name.trim()) {
                    return false;
                }
            } else {
                open.push(tag.split_whitespace().next().unwrap_or(""));
            }
        }
        open.is_empty()
    }

    #[test]
    fn a_chart_of_three_series_is_an_svg_naming_each_in_its_legend() {
        let path = std::env::temp_dir().join(format!("poolipc-plot-{}.svg", std::process::id()));
        let three = [
            series("pool pointer, recycled", 20.0),
            series("host staging", 60.0),
            series("host copy & back <torch>", 200.0),
        ];
        plot_round_trips(&path, "round trip by size", &three).expect("the chart is written");
        let svg = std::fs::read_to_string(&path).expect("the chart reads back");
        let _ = std::fs::remove_file(&path);
        assert!(
            svg.trim_start().starts_with("<svg"),
            "{}",
            &svg[..80.min(svg.len())]
        );
        assert!(svg.trim_end().ends_with("</svg>"));
        assert!(tags_nest(&svg), "the SVG's tags do not nest");
        assert!(svg.contains("round trip by size"));
        assert!(svg.contains("pool pointer, recycled"));
        assert!(svg.contains("host staging"));
        // text is escaped for XML
        assert!(svg.contains("host copy &amp; back &lt;torch&gt;"));
        // the axes say what they are, in binary units
        assert!(svg.contains("tensor size") && svg.contains("round trip (µs)"));
        assert!(svg.contains("KiB") && svg.contains("GiB"));
    }

    #[test]
    fn points_a_log_scale_cannot_show_are_left_out_and_nothing_to_show_is_an_error() {
        let odd = Series {
            name: "odd".into(),
            points: vec![
                (0, 5.0),
                (4096, 0.0),
                (8192, -1.0),
                (1 << 20, f64::NAN),
                (64, 3.0),
            ],
        };
        assert_eq!(plottable(&odd), vec![(64.0, 3.0)]);
        assert!(render("one point", std::slice::from_ref(&odd)).is_ok());
        let nothing = Series {
            name: "nothing".into(),
            points: vec![(0, 1.0), (4096, f64::INFINITY)],
        };
        let err = render("t", &[nothing]).expect_err("nothing to plot");
        assert!(err.to_string().contains("nothing to plot"), "{err}");
        assert!(render("t", &[]).is_err());
    }

    #[test]
    fn a_path_that_cannot_be_written_is_an_error_naming_it() {
        let path = Path::new("/nonexistent-dir-for-poolipc/chart.svg");
        let err = plot_round_trips(path, "t", &[series("a", 1.0)]).expect_err("unwritable");
        assert!(format!("{err:#}").contains("/nonexistent-dir-for-poolipc/chart.svg"));
    }

    #[test]
    fn sizes_read_in_binary_units_and_times_with_the_decimals_they_need() {
        assert_eq!(bytes_label(4096.0), "4 KiB");
        assert_eq!(bytes_label(1.5 * 1048576.0), "1.5 MiB");
        assert_eq!(bytes_label(4.0 * 1073741824.0), "4 GiB");
        assert_eq!(bytes_label(512.0), "512 B");
        assert_eq!(micros_label(1234.4), "1234");
        assert_eq!(micros_label(2.25), "2.2");
        assert_eq!(micros_label(0.125), "0.12");
    }
}
