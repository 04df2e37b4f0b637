//! The replay's picture (`replay --plot FILE.svg|FILE.png`), drawn with `plotters`.
//!
//! One panel per trace, each on its own scale. In a panel: reserved (solid) and allocated
//! (dashed) memory of each replay (config and policy), one colour each; PyTorch's own reserved
//! memory, from the trace's segment events, as a black reference line where the trace has a
//! segment list; the peak of each reserved curve marked and labelled. The x axis is the trace's
//! time (seconds since its first event) where every sample has a time stamp, else the event
//! index; the y axis is in GiB (MiB for a panel that stays under 1 GiB), with a grid. The
//! legend sits beside the data, never on it.
//!
//! Text is set in Ubuntu Light (from `epaint_default_fonts`, embedded), so a PNG looks the same
//! on every machine without system fonts; an SVG names the same family.

use std::path::Path;
use std::sync::Once;

use gpualloc_devices::format_size;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::FontStyle;

use crate::report::{truncate, ReplayReport, Sample};

const WIDTH: u32 = 1280;
const PANEL_HEIGHT: u32 = 420;
const LEGEND_WIDTH: u32 = 430;
const FONT: &str = "sans-serif";
const GIB: f64 = (1u64 << 30) as f64;
const MIB: f64 = (1u64 << 20) as f64;

/// Why a plot could not be written.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// The file name does not end in `.svg` or `.png`.
    #[error("{0}: a plot is written as .svg or .png")]
    Format(String),
    /// Nothing to draw.
    #[error("no replay has samples to plot")]
    Empty,
    /// Drawing or writing failed.
    #[error("cannot draw {path}: {message}")]
    Draw {
        /// The file.
        path: String,
        /// What failed.
        message: String,
    },
}

/// The picture formats, by file extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlotFormat {
    /// `.svg`
    Svg,
    /// `.png`
    Png,
}

impl PlotFormat {
    /// The format `path` names (check it before a long replay, not after).
    pub fn of(path: &Path) -> Result<PlotFormat, PlotError> {
        let ext = path
            .extension()
            .map(|e| e.to_string_lossy().to_ascii_lowercase())
            .unwrap_or_default();
        match ext.as_str() {
            "svg" => Ok(PlotFormat::Svg),
            "png" => Ok(PlotFormat::Png),
            _ => Err(PlotError::Format(path.display().to_string())),
        }
    }
}

/// Draws `reports` (their `samples`) into `path`, an SVG or a PNG by its extension.
pub fn write_plot(path: &Path, reports: &[ReplayReport]) -> Result<(), PlotError> {
    let shown = path.display().to_string();
    let format = PlotFormat::of(path)?;
    let panels = panels(reports);
    if panels.is_empty() {
        return Err(PlotError::Empty);
    }
    register_font();
    let size = (WIDTH, PANEL_HEIGHT * panels.len() as u32);
    let drawn = match format {
        PlotFormat::Svg => draw(SVGBackend::new(path, size).into_drawing_area(), &panels),
        PlotFormat::Png => draw(BitMapBackend::new(path, size).into_drawing_area(), &panels),
    };
    drawn.map_err(|message| PlotError::Draw {
        path: shown,
        message,
    })
}

/// The embedded font, registered once for the whole process.
fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The font is a constant known to be valid; a failure would show as a drawing error.
        let _ = plotters::style::register_font(
            FONT,
            FontStyle::Normal,
            epaint_default_fonts::UBUNTU_LIGHT,
        );
    });
}

/// The reports of one trace, in the order given.
struct Panel<'a> {
    trace: &'a str,
    reports: Vec<&'a ReplayReport>,
}

fn panels(reports: &[ReplayReport]) -> Vec<Panel<'_>> {
    let mut out: Vec<Panel<'_>> = Vec::new();
    for r in reports.iter().filter(|r| !r.samples.is_empty()) {
        match out.iter_mut().find(|p| p.trace == r.trace) {
            Some(p) => p.reports.push(r),
            None => out.push(Panel {
                trace: &r.trace,
                reports: vec![r],
            }),
        }
    }
    out
}

/// How a panel's x axis reads its samples.
#[derive(Clone, Copy)]
enum XAxis {
    /// Seconds since this time stamp (µs).
    Seconds(i64),
    Events,
}

impl XAxis {
    fn of(panel: &Panel<'_>) -> XAxis {
        let mut stamps = panel
            .reports
            .iter()
            .flat_map(|r| r.samples.iter())
            .map(|s| s.time_us);
        match stamps.clone().min().flatten() {
            Some(start) if stamps.all(|t| t.is_some()) => XAxis::Seconds(start),
            _ => XAxis::Events,
        }
    }

    fn x(self, s: &Sample) -> f64 {
        match (self, s.time_us) {
            (XAxis::Seconds(start), Some(t)) => (t - start) as f64 / 1e6,
            _ => s.event as f64,
        }
    }

    fn label(self) -> &'static str {
        match self {
            XAxis::Seconds(_) => "time since the first event (s)",
            XAxis::Events => "event",
        }
    }
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    panels: &[Panel<'_>],
) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(err)?;
    let rows = root.split_evenly((panels.len(), 1));
    for (area, panel) in rows.iter().zip(panels) {
        draw_panel(area, panel)?;
    }
    root.present().map_err(err)
}

fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    panel: &Panel<'_>,
) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    let axis = XAxis::of(panel);
    let samples = || panel.reports.iter().flat_map(|r| r.samples.iter());
    let max_bytes = samples()
        .map(|s| {
            s.reserved
                .max(s.allocated)
                .max(s.torch_reserved.unwrap_or(0))
        })
        .max()
        .unwrap_or(0);
    let (unit, unit_name) = if max_bytes as f64 >= GIB {
        (GIB, "GiB")
    } else {
        (MIB, "MiB")
    };
    let y_max = (max_bytes as f64 / unit * 1.12).max(1e-3);
    let x_max = samples().map(|s| axis.x(s)).fold(0.0, f64::max).max(1e-3);

    let (chart_area, legend_area) = area.split_horizontally(WIDTH - LEGEND_WIDTH);
    let mut chart = ChartBuilder::on(&chart_area)
        .caption(panel.trace, (FONT, 22))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(72)
        .build_cartesian_2d(0f64..x_max, 0f64..y_max)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(axis.label())
        .y_desc(format!("memory ({unit_name})"))
        .y_label_formatter(&|v| format!("{v:.2}"))
        .x_label_formatter(&|v| match axis {
            // Enough decimals that neighbouring ticks differ.
            XAxis::Seconds(_) if x_max < 1.0 => format!("{v:.3}"),
            XAxis::Seconds(_) if x_max < 10.0 => format!("{v:.2}"),
            XAxis::Seconds(_) => format!("{v:.1}"),
            XAxis::Events => format!("{v:.0}"),
        })
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 16))
        .light_line_style(RGBColor(235, 235, 235))
        .bold_line_style(RGBColor(205, 205, 205))
        .draw()
        .map_err(err)?;

    let point = |s: &Sample, bytes: u64| (axis.x(s), bytes as f64 / unit);
    let mut legend: Vec<(String, ShapeStyle, bool)> = Vec::new();

    // PyTorch's recorded reserved memory: one reference line per panel.
    if let Some(r) = panel
        .reports
        .iter()
        .find(|r| r.samples.iter().all(|s| s.torch_reserved.is_some()))
    {
        let style = BLACK.stroke_width(2);
        chart
            .draw_series(LineSeries::new(
                r.samples
                    .iter()
                    .map(|s| point(s, s.torch_reserved.unwrap_or(0))),
                style,
            ))
            .map_err(err)?;
        legend.push(("PyTorch reserved (recorded)".to_string(), style, false));
    }

    for (i, r) in panel.reports.iter().enumerate() {
        let color = Palette99::pick(i * 2 + 1).to_rgba();
        let solid = color.stroke_width(2);
        let dashed = color.stroke_width(1);
        chart
            .draw_series(LineSeries::new(
                r.samples.iter().map(|s| point(s, s.reserved)),
                solid,
            ))
            .map_err(err)?;
        chart
            .draw_series(DashedLineSeries::new(
                r.samples.iter().map(|s| point(s, s.allocated)),
                6,
                4,
                dashed,
            ))
            .map_err(err)?;
        // The reserved peak: marked on the curve, its value in the legend, and numbered on
        // the chart (labels of neighbouring peaks would overlap; numbers stay legible).
        let mut peak_text = String::new();
        if let Some(peak) = r
            .samples
            .iter()
            .max_by_key(|s| (s.reserved, u64::MAX - s.event))
        {
            let (x, y) = point(peak, peak.reserved);
            chart
                .draw_series([Circle::new((x, y), 5, color.filled())])
                .map_err(err)?;
            let number = format!("{}", i + 1);
            let style = TextStyle::from((FONT, 15)).color(&color);
            let dx = x_max * 0.006 * (1 + i) as f64;
            chart
                .draw_series([Text::new(number, (x + dx, y + y_max * 0.06), style)])
                .map_err(err)?;
            peak_text = format!(" (peak {}: {})", i + 1, format_size(peak.reserved));
        }
        let config = if r.config.is_empty() {
            "default"
        } else {
            &r.config
        };
        let name = format!("{} · {}", truncate(config, 26), r.policy);
        legend.push((format!("{name}: reserved{peak_text}"), solid, false));
        legend.push((format!("{name}: allocated"), dashed, true));
    }
    draw_legend(&legend_area, &legend)
}

/// The legend, beside the chart: a line sample and a label per entry.
fn draw_legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    entries: &[(String, ShapeStyle, bool)],
) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    let text = TextStyle::from((FONT, 13)).color(&BLACK);
    let step = ((PANEL_HEIGHT as i32 - 80) / entries.len().max(1) as i32).clamp(12, 22);
    for (i, (label, style, dashed)) in entries.iter().enumerate() {
        let y = 52 + step * i as i32;
        if *dashed {
            for x in (6..36).step_by(10) {
                area.draw(&PathElement::new(vec![(x, y), (x + 6, y)], *style))
                    .map_err(err)?;
            }
        } else {
            area.draw(&PathElement::new(vec![(6, y), (36, y)], *style))
                .map_err(err)?;
        }
        area.draw(&Text::new(label.clone(), (44, y - 8), text.clone()))
            .map_err(err)?;
    }
    Ok(())
}
