// The SVG chart writer: escaping, empty input, rounded ticks, log axes, markers, gaps.
#include "launch/svg_chart.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "tests/strings.hpp"

using namespace dptrain;
using dptrain::test::count_occurrences;

namespace {

// The labels of one axis's ticks ("x-tick" or "y-tick"), in order.
std::vector<std::string> tick_labels(const std::string& svg, const std::string& axis) {
  std::vector<std::string> out;
  const std::regex tick("class=\"tick " + axis + "\"[^>]*>([^<]*)</text>");
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), tick); it != std::sregex_iterator();
       ++it)
    out.push_back((*it)[1].str());
  return out;
}

// The "d" attribute of every series path.
std::vector<std::string> series_paths(const std::string& svg) {
  std::vector<std::string> out;
  const std::regex path("<path class=\"series\" d=\"([^\"]*)\"");
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), path); it != std::sregex_iterator();
       ++it)
    out.push_back((*it)[1].str());
  return out;
}

ChartSeries line(std::string name, std::vector<std::pair<double, double>> points) {
  ChartSeries s;
  s.name = std::move(name);
  s.points = std::move(points);
  return s;
}

// Well-formedness, roughly: every element opened is closed, in order.
bool balanced(const std::string& svg) {
  std::vector<std::string> open;
  const std::regex tag("<(/?)([a-zA-Z]+)[^>]*?(/?)>");
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), tag); it != std::sregex_iterator();
       ++it) {
    const bool closing = (*it)[1].length() > 0, self_closing = (*it)[3].length() > 0;
    const std::string name = (*it)[2].str();
    if (self_closing) continue;
    if (!closing) {
      open.push_back(name);
    } else {
      if (open.empty() || open.back() != name) return false;
      open.pop_back();
    }
  }
  return open.empty();
}

}  // namespace

TEST_CASE("svg chart: one <svg> element with a title, axes, a path per series and a legend") {
  ChartOptions o;
  o.title = "Loss";
  o.x_label = "step";
  o.y_label = "loss";
  const std::string svg = svg_line_chart(
      {line("train", {{0, 2.0}, {10, 1.5}, {20, 1.0}}), line("eval", {{10, 1.7}, {20, 1.2}})}, o);
  CHECK(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0) == 0);
  CHECK(svg.substr(svg.size() - 6) == "</svg>");
  CHECK(count_occurrences(svg, "<svg") == 1);
  CHECK(svg.find("<title>Loss</title>") != std::string::npos);
  CHECK(series_paths(svg).size() == 2);
  CHECK(count_occurrences(svg, "class=\"legend-entry\"") == 2);
  CHECK(svg.find(">train</text>") != std::string::npos);
  CHECK(svg.find(">eval</text>") != std::string::npos);
  CHECK(svg.find(">step</text>") != std::string::npos);
  CHECK(balanced(svg));
  // No scripts and nothing fetched from elsewhere.
  CHECK(svg.find("<script") == std::string::npos);
  CHECK(svg.find("href") == std::string::npos);
  // The first series' first point is at the left edge, the last at the right edge.
  const auto paths = series_paths(svg);
  REQUIRE_FALSE(paths.empty());
  CHECK(paths[0].rfind("M", 0) == 0);
  CHECK(count_occurrences(paths[0], "L") == 2);
}

TEST_CASE("svg chart: text is XML-escaped everywhere: title, labels, legend, markers, colours") {
  ChartOptions o;
  o.title = "a<b & \"c\"";
  o.x_label = "x>0";
  o.y_label = "it's";
  o.markers = {{5, "restart <1> & more", "red\" onload=\"x"}};
  ChartSeries s = line("<script>alert(1)</script>", {{0, 1}, {10, 2}});
  s.color = "blue\"/><script>";
  const std::string svg = svg_line_chart({s}, o);
  CHECK(svg.find("<script") == std::string::npos);
  CHECK(svg.find("&lt;script&gt;alert(1)&lt;/script&gt;") != std::string::npos);
  CHECK(svg.find("a&lt;b &amp; &quot;c&quot;") != std::string::npos);
  CHECK(svg.find("x&gt;0") != std::string::npos);
  CHECK(svg.find("it&#39;s") != std::string::npos);
  CHECK(svg.find("restart &lt;1&gt; &amp; more") != std::string::npos);
  CHECK(svg.find("onload=\"") == std::string::npos);
  CHECK(svg.find("blue&quot;/&gt;&lt;script&gt;") != std::string::npos);
  CHECK(balanced(svg));
  // Control characters are not valid XML even escaped: they become spaces.
  ChartOptions bell;
  bell.title = std::string("ding\x07") + "dong";
  CHECK(svg_line_chart({}, bell).find("<title>ding dong</title>") != std::string::npos);
}

TEST_CASE("svg chart: no series, or only empty ones, give an empty plot saying no data") {
  ChartOptions o;
  o.title = "Throughput";
  const std::string none = svg_line_chart({}, o);
  CHECK(none.find("class=\"no-data\"") != std::string::npos);
  CHECK(none.find(">no data</text>") != std::string::npos);
  CHECK(series_paths(none).empty());
  CHECK(tick_labels(none, "y-tick").empty());
  CHECK(balanced(none));

  // Empty series still appear in the legend; a NaN-only series counts as empty.
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::string empty =
      svg_line_chart({line("samples/s", {}), line("tokens/s", {{1, nan}, {nan, 2}})}, o);
  CHECK(empty.find(">no data</text>") != std::string::npos);
  CHECK(count_occurrences(empty, "class=\"legend-entry\"") == 2);
  CHECK(empty.find(">samples/s</text>") != std::string::npos);
  CHECK(series_paths(empty).empty());

  // Markers alone are not data.
  o.markers = {{10, "restart 1", ""}};
  CHECK(svg_line_chart({}, o).find(">no data</text>") != std::string::npos);
}

TEST_CASE("svg chart: ticks are round numbers with just enough decimals") {
  ChartOptions o;
  SUBCASE("fractions") {
    const std::string svg = svg_line_chart({line("loss", {{0, 0.013}, {300, 0.987}})}, o);
    CHECK(tick_labels(svg, "y-tick") ==
          std::vector<std::string>{"0.0", "0.2", "0.4", "0.6", "0.8", "1.0"});
    CHECK(tick_labels(svg, "x-tick") ==
          std::vector<std::string>{"0", "50", "100", "150", "200", "250", "300"});
  }
  SUBCASE("an axis of whole numbers (ranks) has no fractional ticks") {
    const auto fractional =
        tick_labels(svg_line_chart({line("s/s", {{1, 10}, {2, 19}})}, o), "x-tick");
    CHECK(fractional.size() > 2);  // 1.0, 1.2, ... without the option
    o.integer_x = true;
    CHECK(tick_labels(svg_line_chart({line("s/s", {{1, 10}, {2, 19}})}, o), "x-tick") ==
          std::vector<std::string>{"1", "2"});
  }
  SUBCASE("no floating-point noise in labels (0.1 * 3)") {
    const std::string svg = svg_line_chart({line("lr", {{0, 0.1}, {1, 0.5}})}, o);
    const auto labels = tick_labels(svg, "y-tick");
    CHECK(labels == std::vector<std::string>{"0.1", "0.2", "0.3", "0.4", "0.5"});
  }
  SUBCASE("thousands as k, millions as M") {
    const auto k =
        tick_labels(svg_line_chart({line("s/s", {{0, 12000}, {1, 48000}})}, o), "y-tick");
    CHECK(k.front() == "10k");
    CHECK(k.back() == "50k");
    const auto m =
        tick_labels(svg_line_chart({line("tok/s", {{0, 1.1e6}, {1, 2.9e6}})}, o), "y-tick");
    CHECK(m.front() == "1.0M");
    CHECK(m.back() == "3.0M");
  }
  SUBCASE("tiny values in scientific notation without padded exponents") {
    const auto labels =
        tick_labels(svg_line_chart({line("lr", {{0, 0}, {100, 3e-5}})}, o), "y-tick");
    CHECK(labels.front() == "0");
    CHECK(labels.back() == "3e-5");
    CHECK(std::find(labels.begin(), labels.end(), "1e-5") != labels.end());
    // More digits only where a label needs them: 1e-5 beside 1.2e-5, never 1.0e-5.
    const auto fine =
        tick_labels(svg_line_chart({line("lr", {{0, 1.01e-5}, {1, 1.19e-5}})}, o), "y-tick");
    CHECK(fine.front() == "1e-5");
    CHECK(std::find(fine.begin(), fine.end(), "1.1e-5") != fine.end());
  }
  SUBCASE("small but not tiny: plain decimals") {
    const auto labels =
        tick_labels(svg_line_chart({line("lr", {{0, 0}, {300, 1e-3}})}, o), "y-tick");
    CHECK(labels ==
          std::vector<std::string>{"0.0000", "0.0002", "0.0004", "0.0006", "0.0008", "0.0010"});
  }
  SUBCASE("negative values and a flat series") {
    const auto neg = tick_labels(svg_line_chart({line("d", {{0, -3}, {1, 7}})}, o), "y-tick");
    CHECK(neg.front() == "-4");
    CHECK(neg.back() == "8");
    CHECK(std::find(neg.begin(), neg.end(), "0") != neg.end());
    const std::string flat = svg_line_chart({line("c", {{0, 5}, {10, 5}})}, o);
    CHECK(tick_labels(flat, "y-tick").size() >= 2);
    CHECK(flat.find("nan") == std::string::npos);
    CHECK(flat.find("inf") == std::string::npos);
    const std::string zero = svg_line_chart({line("z", {{3, 0}})}, o);
    CHECK(zero.find("nan") == std::string::npos);
    CHECK(tick_labels(zero, "x-tick").size() >= 2);
  }
}

TEST_CASE("svg chart: log axis ticks at 1-2-5 or powers of ten, non-positive values skipped") {
  ChartOptions o;
  o.log_y = true;
  o.y_label = "loss";
  SUBCASE("within two decades: 1, 2 and 5 times powers of ten") {
    const std::string svg = svg_line_chart({line("loss", {{0, 2.3}, {50, 0.4}, {100, 0.03}})}, o);
    CHECK(tick_labels(svg, "y-tick") ==
          std::vector<std::string>{"0.02", "0.05", "0.1", "0.2", "0.5", "1", "2", "5"});
    CHECK(svg.find(">loss (log)</text>") != std::string::npos);
  }
  SUBCASE("many decades: powers of ten only") {
    const auto labels =
        tick_labels(svg_line_chart({line("l", {{0, 1e-6}, {1, 1e3}})}, o), "y-tick");
    CHECK(labels.front() == "1e-6");
    CHECK(labels.back() == "100");  // every other decade of 1e-6..1000
    CHECK(labels.size() == 5);
    for (const auto& label : labels)
      CHECK(label.find('2') == std::string::npos);
  }
  SUBCASE("zero and negative points are left out of the line, which breaks there") {
    const std::string svg =
        svg_line_chart({line("l", {{0, 1}, {1, 0.5}, {2, 0}, {3, -1}, {4, 0.2}, {5, 0.1}})}, o);
    const auto paths = series_paths(svg);
    REQUIRE(paths.size() == 1);
    CHECK(count_occurrences(paths[0], "M") == 2);  // two pieces: points 0-1 and 4-5
    CHECK(count_occurrences(paths[0], "L") == 2);
    CHECK(tick_labels(svg, "y-tick").front() == "0.1");
  }
  SUBCASE("only non-positive values: no data") {
    CHECK(svg_line_chart({line("l", {{0, 0}, {1, -2}})}, o).find(">no data</text>") !=
          std::string::npos);
  }
}

TEST_CASE("svg chart: markers are vertical lines with labels, inside the x range") {
  ChartOptions o;
  o.markers = {{150, "restart 1: rank 1 killed", ""}, {200, "world size 2 \u2192 1", "#d62728"}};
  const std::string svg = svg_line_chart({line("loss", {{0, 2}, {100, 1}, {300, 0.5}})}, o);
  CHECK(count_occurrences(svg, "<g class=\"marker\">") == 2);
  CHECK(svg.find("<title>restart 1: rank 1 killed</title>") != std::string::npos);
  CHECK(svg.find("world size 2 \u2192 1</text>") != std::string::npos);
  CHECK(svg.find("stroke=\"#d62728\"") != std::string::npos);
  // The marker at 150 of 0..300 is halfway across the plot: its line's x is the mean of the
  // first point's and the last point's x.
  const std::regex marker_x(
      "<g class=\"marker\"><title>restart[^<]*</title><line x1=\"([0-9.]+)\"");
  std::smatch m;
  REQUIRE(std::regex_search(svg, m, marker_x));
  const auto path = series_paths(svg).at(0);
  const double first = std::stod(path.substr(1, path.find(',') - 1));
  const double last = std::stod(path.substr(path.rfind('L') + 1));
  CHECK(std::stod(m[1].str()) == doctest::Approx((first + last) / 2).epsilon(0.01));

  // A marker past the data widens the x axis so that it is still drawn inside the plot.
  o.markers = {{500, "late", ""}};
  const auto labels =
      tick_labels(svg_line_chart({line("loss", {{0, 2}, {300, 0.5}})}, o), "x-tick");
  CHECK(labels.back() == "500");
}

TEST_CASE("svg chart: dashed lines, dots on points, a lone point, palette and given colours") {
  ChartOptions o;
  ChartSeries ideal = line("ideal", {{1, 1}, {2, 2}, {4, 4}});
  ideal.dashed = true;
  ideal.color = "#999";
  ChartSeries measured = line("measured", {{1, 1}, {2, 1.9}, {4, 3.5}});
  measured.markers = true;
  const std::string svg = svg_line_chart({measured, ideal, line("one", {{3, 2}})}, o);
  CHECK(series_paths(svg).size() == 3);
  CHECK(count_occurrences(svg, "stroke-dasharray=\"6 4\"") == 1);
  CHECK(svg.find("stroke=\"#999\"") != std::string::npos);
  CHECK(svg.find("stroke=\"#1f77b4\"") != std::string::npos);  // the palette's first colour
  CHECK(count_occurrences(svg, "<circle") == 4);               // three dots + the lone point
  CHECK(balanced(svg));
}

TEST_CASE("svg chart: a long line keeps a few points per column, its spikes included") {
  // 200,000 steps of a noisy loss with one spike: the path is not 200,000 points long, and the
  // spike is still drawn.
  std::vector<std::pair<double, double>> points;
  for (int i = 0; i < 200000; ++i)
    points.emplace_back(i, 2.0 + 0.1 * std::sin(i * 0.37) + (i == 123457 ? 5.0 : 0.0));
  ChartOptions o;
  const std::string svg = svg_line_chart({line("loss", points)}, o);
  CHECK(svg.size() < 200000);
  // The path's points (std::regex would recurse too deep on so long an attribute).
  const std::string key = "<path class=\"series\" d=\"";
  const size_t start = svg.find(key);
  REQUIRE(start != std::string::npos);
  std::istringstream d(
      svg.substr(start + key.size(), svg.find('"', start + key.size()) - start - key.size()));
  std::vector<std::pair<double, double>> at;
  char command = 0, comma = 0;
  double x = 0, y = 0;
  while (d >> command >> x >> comma >> y) {
    CHECK((command == (at.empty() ? 'M' : 'L')));
    at.emplace_back(x, y);
  }
  CHECK(at.size() <= 8 * static_cast<size_t>(o.width));
  CHECK(at.size() >= static_cast<size_t>(o.width) / 2);  // every column still has its points
  CHECK(std::is_sorted(at.begin(), at.end(),
                       [](const auto& a, const auto& b) { return a.first < b.first; }));
  // y grows downwards: the spike is the smallest y, far above the first point.
  const auto top = std::min_element(
      at.begin(), at.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
  CHECK(top->second < at.front().second - 50);
}

TEST_CASE("xml_escape: markup escaped, control characters and bytes that are not UTF-8 replaced") {
  CHECK(xml_escape("a<b & \"c\" 'd'>") == "a&lt;b &amp; &quot;c&quot; &#39;d&#39;&gt;");
  CHECK(xml_escape("x\x01y\tz") == "x y\tz");
  CHECK(xml_escape("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80") ==
        "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80");
  const std::string replacement = "\xef\xbf\xbd";
  CHECK(xml_escape("lat\xe9run") == "lat" + replacement + "run");                // Latin-1
  CHECK(xml_escape("\xc0\xaf") == replacement + replacement);                    // overlong
  CHECK(xml_escape("\xed\xa0\x80") == replacement + replacement + replacement);  // surrogate
  CHECK(xml_escape("end\xe2\x82") == "end" + replacement + replacement);         // cut short
  // Not characters XML allows; U+FFFD and U+FFFC are.
  CHECK(xml_escape("\xef\xbf\xbe|\xef\xbf\xbf|\xef\xbf\xbd|\xef\xbf\xbc") ==
        replacement + "|" + replacement + "|\xef\xbf\xbd|\xef\xbf\xbc");
}
