#include "kvpool/router/router_server.h"

int main(int argc, char** argv) { return kvpool::router::RunRouterMain(argc, argv); }
