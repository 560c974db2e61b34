// Self-contained SVG line charts (no scripts, no external resources) for run reports and the
// training-scaling chart of `dptrain bench train`.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace dptrain {

struct ChartSeries {
  std::string name;                               // in the legend
  std::vector<std::pair<double, double>> points;  // (x, y), x ascending
  std::string color;                              // CSS colour; empty: from a fixed palette
  bool dashed = false;                            // e.g. an "ideal scaling" line
  bool markers = false;                           // a dot on every point
};

// A vertical line across the plot at x, with a short label (a restart, a world-size change).
struct ChartMarker {
  double x = 0;
  std::string label;
  std::string color;  // empty: grey
};

struct ChartOptions {
  std::string title;
  std::string x_label;
  std::string y_label;
  int width = 720;
  int height = 320;
  bool log_y = false;      // for losses spanning decades; non-positive values are skipped
  bool integer_x = false;  // x counts things (ranks): ticks at whole numbers only
  std::vector<ChartMarker> markers;
};

// Text for XML and HTML content and attribute values: & < > " ' escaped; control characters
// other than tab and newlines (not allowed in XML at all) become spaces, and bytes that are not
// well-formed UTF-8 U+FFFD (the page's encoding).
std::string xml_escape(const std::string& text);

// One <svg> element (with a <title>, axes with rounded tick labels, grid, legend). Text is
// XML-escaped. Series without points are listed in the legend only; no series at all gives an
// empty plot saying "no data".
std::string svg_line_chart(const std::vector<ChartSeries>& series, const ChartOptions& options);

}  // namespace dptrain
