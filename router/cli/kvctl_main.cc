#include <iostream>

#include "kvctl.h"
#include "kvpool/common/service_main.h"

int main(int argc, char** argv) {
  kvpool::InitProcess();
  return kvpool::kvctl::RunKvctl(std::vector<std::string>(argv, argv + argc), std::cout, std::cerr);
}
