// Self-contained SVG line charts: axes with rounded ticks, grid, legend, vertical markers.
#include "launch/svg_chart.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include <fmt/format.h>

namespace dptrain {

namespace {

constexpr const char* kPalette[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728",
                                    "#9467bd", "#8c564b", "#e377c2", "#17becf"};
constexpr const char* kMarkerColor = "#888888";
constexpr double kCharWidth = 6.2;  // px per character of the 11px sans-serif labels, roughly

double text_width(const std::string& text) {
  return static_cast<double>(text.size()) * kCharWidth;
}

// "2e-5" rather than "2e-05"; `digits` significant digits.
std::string scientific(double v, int digits) {
  std::string s = fmt::format("{:.{}e}", v, std::max(0, digits - 1));
  const auto e = s.find('e');
  std::string mantissa = s.substr(0, e);
  if (mantissa.find('.') != std::string::npos) {
    mantissa.erase(mantissa.find_last_not_of('0') + 1);  // ticks are multiples of the step
    if (mantissa.back() == '.') mantissa.pop_back();
  }
  std::string exponent = s.substr(e + 1);
  const bool negative = exponent[0] == '-';
  exponent = exponent.substr(1);
  exponent.erase(0, std::min(exponent.find_first_not_of('0'), exponent.size() - 1));
  return mantissa + "e" + (negative ? "-" : "") + exponent;
}

// A tick label for `v`, a multiple of `step`, on an axis whose largest magnitude is `extent`:
// just enough decimals for the step, thousands as k/M/G, tiny steps in scientific notation.
std::string format_tick(double v, double step, double extent) {
  const bool zero = std::fabs(v) < step * 1e-6;
  if (zero) v = 0;  // never "-0.0"
  if (extent >= 1e4 && extent < 1e15) {
    if (zero) return "0";
    const double scale = extent >= 1e12 ? 1e12 : extent >= 1e9 ? 1e9 : extent >= 1e6 ? 1e6 : 1e3;
    const char* suffix = extent >= 1e12 ? "T" : extent >= 1e9 ? "G" : extent >= 1e6 ? "M" : "k";
    const int decimals =
        std::max(0, static_cast<int>(-std::floor(std::log10(step / scale) + 1e-9)));
    return fmt::format("{:.{}f}{}", v / scale, decimals, suffix);
  }
  if (step < 1e-4 || extent >= 1e15) {
    if (zero) return "0";
    const int digits = static_cast<int>(std::floor(std::log10(std::fabs(v)) + 1e-9) -
                                        std::floor(std::log10(step) + 1e-9)) +
                       1;
    return scientific(v, std::max(1, digits));
  }
  const int decimals = std::max(0, static_cast<int>(-std::floor(std::log10(step) + 1e-9)));
  return fmt::format("{:.{}f}", v, decimals);
}

struct Axis {
  double lo = 0, hi = 1;
  bool log = false;
  std::vector<double> ticks;
  std::vector<std::string> labels;

  // 0..1 along the axis.
  double fraction(double v) const {
    if (log) return (std::log10(v) - std::log10(lo)) / (std::log10(hi) - std::log10(lo));
    return (v - lo) / (hi - lo);
  }
};

// 1, 2 or 5 times a power of ten, the smallest one not below `raw`.
double nice_step(double raw) {
  const double power = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / power;
  const double nice = f <= 1.0 + 1e-9 ? 1 : f <= 2.0 + 1e-9 ? 2 : f <= 5.0 + 1e-9 ? 5 : 10;
  return nice * power;
}

// `min_step`: the smallest step between ticks (1 for an axis of whole numbers).
Axis linear_axis(double min, double max, int target_ticks, double min_step = 0) {
  if (min == max) {
    const double pad = min == 0 ? 1.0 : std::fabs(min) * 0.1;
    min -= pad;
    max += pad;
  }
  const double step = std::max(nice_step((max - min) / std::max(1, target_ticks)), min_step);
  // Tick k is k * step: computed from the integer, so labels carry no accumulated error.
  const double first = std::floor(min / step + 1e-9);
  const double last = std::ceil(max / step - 1e-9);
  Axis axis;
  axis.lo = first * step;
  axis.hi = last * step;
  const double extent = std::max(std::fabs(axis.lo), std::fabs(axis.hi));
  for (double k = first; k <= last + 0.5; k += 1) {
    const double v = k * step;
    axis.ticks.push_back(v);
    axis.labels.push_back(format_tick(v, step, extent));
  }
  return axis;
}

std::string format_log_tick(double v) {
  const int exponent = static_cast<int>(std::floor(std::log10(v) + 1e-9));
  if (exponent >= 4) return format_tick(v, std::pow(10.0, exponent), v);
  if (exponent <= -4) return scientific(v, 1);
  return fmt::format("{:.{}f}", v, std::max(0, -exponent));
}

// Bounds at 1, 2 or 5 times a power of ten around the data; ticks at those values when the
// axis spans a few decades at most, else at the powers of ten only.
Axis log_axis(double min, double max) {
  const auto below = [](double v) {
    const double power = std::pow(10.0, std::floor(std::log10(v) + 1e-9));
    const double f = v / power;
    return (f >= 5 - 1e-9 ? 5 : f >= 2 - 1e-9 ? 2 : 1) * power;
  };
  const auto above = [](double v) {
    const double power = std::pow(10.0, std::floor(std::log10(v) - 1e-9));
    const double f = v / power;
    return (f <= 1 + 1e-9 ? 1 : f <= 2 + 1e-9 ? 2 : f <= 5 + 1e-9 ? 5 : 10) * power;
  };
  Axis axis;
  axis.log = true;
  axis.lo = below(min);
  axis.hi = above(max);
  if (axis.hi <= axis.lo) axis.hi = above(axis.lo * 1.5);
  const bool fine = std::log10(axis.hi / axis.lo) <= 2.5;
  const int from = static_cast<int>(std::floor(std::log10(axis.lo) + 1e-9));
  const int to = static_cast<int>(std::ceil(std::log10(axis.hi) - 1e-9));
  const int every = std::max(1, (to - from + 7) / 8);  // at most about 8 labelled decades
  for (int e = from; e <= to; ++e) {
    for (const double m : {1.0, 2.0, 5.0}) {
      if (m != 1.0 && !fine) continue;
      if (m == 1.0 && !fine && (e - from) % every != 0) continue;
      const double v = m * std::pow(10.0, e);
      if (v < axis.lo * (1 - 1e-9) || v > axis.hi * (1 + 1e-9)) continue;
      axis.ticks.push_back(v);
      axis.labels.push_back(format_log_tick(v));
    }
  }
  return axis;
}

bool usable(double x, double y, bool log_y) {
  return std::isfinite(x) && std::isfinite(y) && (!log_y || y > 0);
}

std::string color_of(const ChartSeries& s, size_t index) {
  if (!s.color.empty()) return s.color;
  return kPalette[index % std::size(kPalette)];
}

struct Frame {
  double left, top, width, height;
  double right() const { return left + width; }
  double bottom() const { return top + height; }
};

std::string px(double v) {
  return fmt::format("{:.1f}", v);
}

// One row of legend entries per line, wrapped to the chart's width; returns the rows' height.
double write_legend(std::string& svg, const std::vector<ChartSeries>& series, double left,
                    double right, double top) {
  if (series.empty()) return 0;
  double x = left, y = top + 8;
  for (size_t i = 0; i < series.size(); ++i) {
    const ChartSeries& s = series[i];
    const double entry = 22 + text_width(s.name) + 16;
    if (x > left && x + entry > right) {
      x = left;
      y += 16;
    }
    const std::string color = xml_escape(color_of(s, i));
    svg += fmt::format(
        "<g class=\"legend-entry\"><line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"{}\" "
        "stroke-width=\"2\"{}/><text x=\"{}\" y=\"{}\" fill=\"#333\">{}</text></g>",
        px(x), px(y), px(x + 18), px(y), color, s.dashed ? " stroke-dasharray=\"5 3\"" : "",
        px(x + 22), px(y + 4), xml_escape(s.name));
    x += entry;
  }
  return y - top + 12;
}

// The points of a line as drawn: where many fall in one column (half a pixel wide) only the
// first, lowest, highest and last of them, in their order, which draws the same envelope. A
// run of 500,000 logged steps made a 53 MB report; now a line has at most ~8 points a pixel.
class ColumnThinner {
 public:
  explicit ColumnThinner(std::vector<std::pair<double, double>>& out) : out_(out) {}
  void add(double x, double y) {
    const double column = std::floor(x * 2);
    if (!run_.empty() && column != column_) flush();
    column_ = column;
    run_.emplace_back(x, y);
  }
  // Ends the column being filled (before a gap, and at the end).
  void flush() {
    if (run_.size() <= 4) {
      out_.insert(out_.end(), run_.begin(), run_.end());
    } else {
      size_t low = 0, high = 0;
      for (size_t i = 1; i < run_.size(); ++i) {
        if (run_[i].second < run_[low].second) low = i;
        if (run_[i].second > run_[high].second) high = i;
      }
      std::vector<size_t> keep = {0, low, high, run_.size() - 1};
      std::sort(keep.begin(), keep.end());
      keep.erase(std::unique(keep.begin(), keep.end()), keep.end());
      for (size_t i : keep)
        out_.push_back(run_[i]);
    }
    run_.clear();
  }

 private:
  std::vector<std::pair<double, double>>& out_;
  std::vector<std::pair<double, double>> run_;
  double column_ = 0;
};

void write_series(std::string& svg, const ChartSeries& s, size_t index, const Axis& xa,
                  const Axis& ya, const Frame& f, bool log_y) {
  std::string d;
  std::string dots;
  size_t drawn = 0;
  std::vector<std::pair<double, double>> at;
  std::vector<std::pair<double, double>> stroke;  // the points of one unbroken line
  ColumnThinner thinner(stroke);
  const auto draw = [&] {
    thinner.flush();
    for (size_t i = 0; i < stroke.size(); ++i)
      d += fmt::format("{}{},{}", i == 0 ? "M" : "L", px(stroke[i].first), px(stroke[i].second));
    drawn += stroke.size();
    at.insert(at.end(), stroke.begin(), stroke.end());
    stroke.clear();
  };
  for (const auto& [x, y] : s.points) {
    if (!usable(x, y, log_y)) {
      draw();  // a gap in the line
      continue;
    }
    const double px_x = f.left + xa.fraction(x) * f.width;
    const double px_y = f.bottom() - ya.fraction(y) * f.height;
    if (s.markers) {
      stroke.emplace_back(px_x, px_y);  // every point gets its dot
    } else {
      thinner.add(px_x, px_y);
    }
  }
  draw();
  if (drawn == 0) return;
  const std::string color = xml_escape(color_of(s, index));
  svg += fmt::format(
      "<path class=\"series\" d=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"1.6\" "
      "stroke-linejoin=\"round\"{}><title>{}</title></path>",
      d, color, s.dashed ? " stroke-dasharray=\"6 4\"" : "", xml_escape(s.name));
  // A lone point draws no line: it gets a dot like a series with markers.
  if (s.markers || drawn == 1) {
    for (const auto& [x, y] : at)
      dots += fmt::format("<circle cx=\"{}\" cy=\"{}\" r=\"2.6\"/>", px(x), px(y));
    svg += fmt::format("<g class=\"points\" fill=\"{}\">{}</g>", color, dots);
  }
}

void write_markers(std::string& svg, const std::vector<ChartMarker>& markers, const Axis& xa,
                   const Frame& f) {
  int row = 0;
  for (const ChartMarker& m : markers) {
    if (!std::isfinite(m.x)) continue;
    const double x = f.left + xa.fraction(m.x) * f.width;
    const std::string color = xml_escape(m.color.empty() ? kMarkerColor : m.color);
    // Labels of nearby markers would overlap: they take turns on three rows.
    const double y = f.top + 11 + 12 * (row++ % 3);
    const bool flip = x + 4 + text_width(m.label) * 0.9 > f.right();
    svg += fmt::format(
        "<g class=\"marker\"><title>{}</title><line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" "
        "stroke=\"{}\" stroke-width=\"1.2\" stroke-dasharray=\"4 3\"/><text x=\"{}\" y=\"{}\" "
        "fill=\"{}\" font-size=\"10\" text-anchor=\"{}\">{}</text></g>",
        xml_escape(m.label), px(x), px(f.top), px(x), px(f.bottom()), color,
        px(flip ? x - 4 : x + 4), px(y), color, flip ? "end" : "start", xml_escape(m.label));
  }
}

}  // namespace

namespace {

// The length of the well-formed UTF-8 sequence `text` starts with (1 to 4 bytes); 0 when it does
// not start with one (a stray byte, an overlong form, a surrogate, past U+10FFFF, cut short).
size_t utf8_sequence(std::string_view text) {
  const auto byte = [&text](size_t i) { return static_cast<unsigned char>(text[i]); };
  const unsigned char lead = byte(0);
  if (lead < 0x80) return 1;
  size_t n = 0;
  unsigned char low = 0x80, high = 0xBF;  // the range of the second byte
  if (lead >= 0xC2 && lead <= 0xDF) {
    n = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    n = 3;
    if (lead == 0xE0) low = 0xA0;
    if (lead == 0xED) high = 0x9F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    n = 4;
    if (lead == 0xF0) low = 0x90;
    if (lead == 0xF4) high = 0x8F;
  } else {
    return 0;
  }
  if (text.size() < n || byte(1) < low || byte(1) > high) return 0;
  for (size_t i = 2; i < n; ++i) {
    if (byte(i) < 0x80 || byte(i) > 0xBF) return 0;
  }
  return n;
}

}  // namespace

std::string xml_escape(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (static_cast<unsigned char>(c) >= 0x80) {
      // The page says UTF-8: a byte that is not part of UTF-8 (a path in another encoding) is
      // U+FFFD, as in every JSON file dptrain writes; so are U+FFFE and U+FFFF, which XML does
      // not allow.
      const size_t n = utf8_sequence(std::string_view(text).substr(i));
      const bool allowed = n != 0 && !(n == 3 && text.compare(i, 2, "\xEF\xBF") == 0 &&
                                       static_cast<unsigned char>(text[i + 2]) >= 0xBE);
      out += allowed ? text.substr(i, n) : std::string("\xEF\xBF\xBD");
      if (n > 1) i += n - 1;
      continue;
    }
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        // Control characters are not allowed in XML 1.0 at all, not even as references.
        if (static_cast<unsigned char>(c) < 0x20 && c != '\t' && c != '\n' && c != '\r') {
          out += ' ';
        } else {
          out += c;
        }
    }
  }
  return out;
}

std::string svg_line_chart(const std::vector<ChartSeries>& series, const ChartOptions& options) {
  const int width = std::max(options.width, 200);
  const int height = std::max(options.height, 120);
  const std::string title = xml_escape(options.title);
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"chart\" width=\"{0}\" height=\"{1}\" "
      "viewBox=\"0 0 {0} {1}\" role=\"img\" aria-label=\"{2}\" font-family=\"sans-serif\" "
      "font-size=\"11\"><title>{2}</title><rect width=\"{0}\" height=\"{1}\" fill=\"#fff\"/>",
      width, height, title);

  double x_min = std::numeric_limits<double>::infinity(), x_max = -x_min;
  double y_min = x_min, y_max = -x_min;
  for (const auto& s : series) {
    for (const auto& [x, y] : s.points) {
      if (!usable(x, y, options.log_y)) continue;
      x_min = std::min(x_min, x);
      x_max = std::max(x_max, x);
      y_min = std::min(y_min, y);
      y_max = std::max(y_max, y);
    }
  }
  const bool has_data = x_min <= x_max;
  if (has_data) {
    for (const auto& m : options.markers) {
      if (!std::isfinite(m.x)) continue;
      x_min = std::min(x_min, m.x);
      x_max = std::max(x_max, m.x);
    }
  }

  double top = 8;
  if (!options.title.empty()) {
    svg += fmt::format(
        "<text class=\"chart-title\" x=\"12\" y=\"20\" font-size=\"14\" font-weight=\"bold\" "
        "fill=\"#222\">{}</text>",
        title);
    top = 30;
  }
  top += write_legend(svg, series, 12, width - 12, top) + 6;

  const double bottom_margin = options.x_label.empty() ? 24 : 40;
  const double plot_height = std::max(20.0, height - top - bottom_margin);
  Axis xa, ya;
  double left = 16;
  if (has_data) {
    xa = linear_axis(x_min, x_max, std::max(2, width / 110), options.integer_x ? 1.0 : 0.0);
    ya = options.log_y ? log_axis(y_min, y_max)
                       : linear_axis(y_min, y_max, std::max(2, static_cast<int>(plot_height / 45)));
    double widest = 0;
    for (const auto& label : ya.labels)
      widest = std::max(widest, text_width(label));
    left = std::max(left, widest + 14);
  }
  if (!options.y_label.empty()) left += 16;
  const Frame f{left, top, width - left - 16, plot_height};

  if (!has_data) {
    svg += fmt::format(
        "<rect class=\"plot\" x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"#fafafa\" "
        "stroke=\"#ccc\"/><text class=\"no-data\" x=\"{}\" y=\"{}\" text-anchor=\"middle\" "
        "fill=\"#777\" font-size=\"13\">no data</text></svg>",
        px(f.left), px(f.top), px(f.width), px(f.height), px(f.left + f.width / 2),
        px(f.top + f.height / 2 + 4));
    return svg;
  }

  std::string grid, ticks;
  for (size_t i = 0; i < ya.ticks.size(); ++i) {
    const double y = f.bottom() - ya.fraction(ya.ticks[i]) * f.height;
    grid += fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\"/>", px(f.left), px(y),
                        px(f.right()), px(y));
    ticks +=
        fmt::format("<text class=\"tick y-tick\" x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>",
                    px(f.left - 6), px(y + 4), xml_escape(ya.labels[i]));
  }
  for (size_t i = 0; i < xa.ticks.size(); ++i) {
    const double x = f.left + xa.fraction(xa.ticks[i]) * f.width;
    grid += fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\"/>", px(x), px(f.top), px(x),
                        px(f.bottom()));
    ticks += fmt::format(
        "<text class=\"tick x-tick\" x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>", px(x),
        px(f.bottom() + 15), xml_escape(xa.labels[i]));
  }
  svg += fmt::format("<g class=\"grid\" stroke=\"#e6e6e6\" stroke-width=\"1\">{}</g>", grid);
  svg += fmt::format(
      "<path class=\"axes\" d=\"M{},{}V{}H{}\" fill=\"none\" stroke=\"#444\" "
      "stroke-width=\"1\"/>",
      px(f.left), px(f.top), px(f.bottom()), px(f.right()));
  svg += fmt::format("<g class=\"ticks\" fill=\"#444\">{}</g>", ticks);
  if (!options.x_label.empty()) {
    svg += fmt::format(
        "<text class=\"axis-label\" x=\"{}\" y=\"{}\" text-anchor=\"middle\" "
        "fill=\"#333\">{}</text>",
        px(f.left + f.width / 2), px(f.bottom() + 32), xml_escape(options.x_label));
  }
  if (!options.y_label.empty()) {
    const double x = 14, y = f.top + f.height / 2;
    svg += fmt::format(
        "<text class=\"axis-label\" x=\"{0}\" y=\"{1}\" text-anchor=\"middle\" fill=\"#333\" "
        "transform=\"rotate(-90 {0} {1})\">{2}</text>",
        px(x), px(y), xml_escape(options.y_label + (options.log_y ? " (log)" : "")));
  }
  write_markers(svg, options.markers, xa, f);
  for (size_t i = 0; i < series.size(); ++i)
    write_series(svg, series[i], i, xa, ya, f, options.log_y);
  svg += "</svg>";
  return svg;
}

}  // namespace dptrain
