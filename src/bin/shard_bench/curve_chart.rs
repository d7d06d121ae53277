//! How a cost grows, as a picture: panels side by side, each a log–log
//! chart of one cost against the size of the work, one line per series
//! (SVG, drawn by plotters); and the same on linear axes, for figures
//! over a run's time.

use std::path::Path;

use plotters::prelude::*;

/// One line of a panel: its label and its points (size, cost), sizes
/// ascending.
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// One panel: a title, the axes' names, its lines.
pub struct Panel {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
}

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// The bounds of every point of `panel`, widened to whole powers of ten so
/// that a log axis has its marks.
fn bounds(panel: &Panel) -> ((f64, f64), (f64, f64)) {
    let points = || panel.series.iter().flat_map(|s| s.points.iter());
    let min = |f: fn(&(f64, f64)) -> f64| points().map(f).fold(f64::INFINITY, f64::min);
    let max = |f: fn(&(f64, f64)) -> f64| points().map(f).fold(0.0, f64::max);
    let down = |v: f64| 10f64.powf(v.max(1e-9).log10().floor());
    let up = |v: f64| 10f64.powf(v.max(1e-9).log10().ceil()).max(down(v) * 10.0);
    (
        (down(min(|p| p.0)), up(max(|p| p.0))),
        (down(min(|p| p.1)), up(max(|p| p.1))),
    )
}

/// Draws `panels` side by side into an SVG at `path`.
pub fn draw(path: &Path, panels: &[Panel]) -> Result<(), Box<dyn std::error::Error>> {
    let width = 520 * panels.len().max(1) as u32;
    let root = SVGBackend::new(path, (width, 420)).into_drawing_area();
    root.fill(&WHITE)?;
    let areas = root.split_evenly((1, panels.len().max(1)));
    for (panel, area) in panels.iter().zip(areas.iter()) {
        let ((x0, x1), (y0, y1)) = bounds(panel);
        let mut chart = ChartBuilder::on(area)
            .caption(&panel.title, ("sans-serif", 17))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(64)
            .build_cartesian_2d((x0..x1).log_scale(), (y0..y1).log_scale())?;
        chart
            .configure_mesh()
            .x_desc(panel.x_label.as_str())
            .y_desc(panel.y_label.as_str())
            .x_label_formatter(&|v| short(*v))
            .y_label_formatter(&|v| short(*v))
            .draw()?;
        lines(&mut chart, panel, true, SeriesLabelPosition::UpperLeft)?;
    }
    root.present()?;
    Ok(())
}

/// Draws `panels` side by side into an SVG at `path`, on linear axes from
/// zero (x: time, y up to 1 when every point is a fraction).
pub fn draw_linear(path: &Path, panels: &[Panel]) -> Result<(), Box<dyn std::error::Error>> {
    let width = 520 * panels.len().max(1) as u32;
    let root = SVGBackend::new(path, (width, 420)).into_drawing_area();
    root.fill(&WHITE)?;
    let areas = root.split_evenly((1, panels.len().max(1)));
    for (panel, area) in panels.iter().zip(areas.iter()) {
        let points = || panel.series.iter().flat_map(|s| s.points.iter());
        let x1 = points().map(|p| p.0).fold(1.0, f64::max);
        let y_max = points().map(|p| p.1).fold(0.0, f64::max);
        let y1 = if y_max <= 1.0 { 1.0 } else { y_max * 1.1 };
        let mut chart = ChartBuilder::on(area)
            .caption(&panel.title, ("sans-serif", 17))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(64)
            .build_cartesian_2d(0.0..x1, 0.0..y1)?;
        chart
            .configure_mesh()
            .x_desc(panel.x_label.as_str())
            .y_desc(panel.y_label.as_str())
            .x_label_formatter(&|v| linear(*v))
            .y_label_formatter(&|v| linear(*v))
            .draw()?;
        lines(&mut chart, panel, false, SeriesLabelPosition::LowerRight)?;
    }
    root.present()?;
    Ok(())
}

/// Draws `panel`'s lines into `chart` (with a dot at each point if
/// `dots`), and their legend at `legend`.
fn lines<'a, CT: CoordTranslate<From = (f64, f64)>>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, CT>,
    panel: &Panel,
    dots: bool,
    legend: SeriesLabelPosition,
) -> Result<(), Box<dyn std::error::Error>> {
    for (i, series) in panel.series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(series.points.iter().copied(), color))?
            .label(series.label.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        if dots {
            let points = series.points.iter();
            chart.draw_series(points.map(|p| Circle::new(*p, 3, color.filled())))?;
        }
    }
    chart
        .configure_series_labels()
        .position(legend)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

/// A linear axis' mark: 150000 → "150k", 0.30000000000000004 → "0.3",
/// 20 → "20".
fn linear(v: f64) -> String {
    if v >= 1e3 {
        return short(v);
    }
    let fixed = format!("{v:.2}");
    fixed.trim_end_matches('0').trim_end_matches('.').to_owned()
}

/// 1500 → "1.5k", 0.02 → "0.02".
fn short(v: f64) -> String {
    if v >= 1e6 {
        format!("{}M", v / 1e6)
    } else if v >= 1e3 {
        format!("{}k", v / 1e3)
    } else {
        format!("{v}")
    }
}
