from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("recovery", "0012_experiment_runs"),
    ]

    operations = [
        migrations.AddField(
            model_name="node",
            name="server",
            field=models.CharField(
                blank=True, help_text="The machine whose PCIe bus its GPUs share; blank: one of its own.", max_length=63
            ),
        ),
        migrations.AddField(
            model_name="node",
            name="nvl_domain",
            field=models.CharField(
                blank=True,
                help_text="The NVLink domain its GPUs belong to; blank: none.",
                max_length=63,
                verbose_name="NVLink domain",
            ),
        ),
        migrations.AddField(
            model_name="node",
            name="network",
            field=models.CharField(default="infiniband", help_text="The network between servers.", max_length=16),
        ),
    ]
