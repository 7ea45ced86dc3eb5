// The JSON line a benchmark prints for each result, through nlohmann-json: the keys stay in the
// order they are added (ordered_json), and measurements are rounded to the digits that are not
// noise.
#pragma once

#include <cmath>
#include <iostream>
#include <nlohmann/json.hpp>

namespace bench {

using JsonLine = nlohmann::ordered_json;

// x to `decimals` places after the point.
inline double rounded(double x, int decimals) {
  const double scale = std::pow(10.0, decimals);
  return std::round(x * scale) / scale;
}

// Writes the line to stdout and flushes it: the launcher relays a worker's output as it comes.
inline void print_line(const JsonLine& line) { std::cout << line.dump() << std::endl; }

}  // namespace bench
