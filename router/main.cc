#include "kvpool/common/service_main.h"
#include "kvpool/router/router_server.h"

int main(int argc, char** argv) {
  kvpool::InitProcess();
  return kvpool::router::RunRouterMain(argc, argv);
}
