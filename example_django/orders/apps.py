from django.apps import AppConfig


class OrdersConfig(AppConfig):
    name = "example_django.orders"
    label = "orders"
