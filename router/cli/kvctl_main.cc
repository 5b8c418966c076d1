#include <iostream>

#include "kvctl.h"

int main(int argc, char** argv) {
  return kvpool::kvctl::RunKvctl(std::vector<std::string>(argv, argv + argc), std::cout, std::cerr);
}
