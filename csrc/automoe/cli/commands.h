// The `automoe` subcommands; each takes its own arguments (argv after the subcommand name) and
// returns the process exit code.
#pragma once

#include <string>
#include <vector>

namespace automoe::cli {

using Args = std::vector<std::string>;

int inspect(const Args& args);
int convert(const Args& args);
int bench(const Args& args);
int train(const Args& args);
int export_adapter(const Args& args);

}  // namespace automoe::cli
